"""A tool-use task small enough for CPU tests: "Q: 3+4" -> a calculator call -> "A: 7"."""

"""Prompt data: files -> rendered, tokenised prompts -> resumable batches of DataProto.

    reading.py    .jsonl / .json / .parquet rows, malformed rows reported with line numbers
    templates.py  chat templates (tokenizer's, named, or Jinja)
    dataset.py    RLDataset: validation, rendering, length filtering / truncation
    loader.py     PromptLoader: deterministic per-epoch order, exact resume, collate
    build.py      build_dataset / build_loaders from the config (a user's dataset class by path)

Import names from the module that defines them (the package itself exports nothing).
"""

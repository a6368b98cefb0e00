"""Files megarl writes and reads back: private durable writes (durable.py) and weights-only plain
data (plain_state.py). Neither imports the rest of megarl."""

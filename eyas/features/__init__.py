"""Features: the target run over tokenized conversations, and the offline store of its taps."""

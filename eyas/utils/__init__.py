"""Small helpers shared by every stage: atomic writes, cache folders, errors."""

"""Proposers: every drafting method behind one interface (see base.py)."""

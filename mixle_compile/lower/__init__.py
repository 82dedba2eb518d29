"""Lowering: a verified spec becomes what each rank holds and does."""

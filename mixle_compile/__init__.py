"""mixle-compile: a declarative config compiler with static verification for distributed training plans."""

__version__ = "0.1.0"

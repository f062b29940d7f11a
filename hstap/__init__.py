"""hstap — hidden-state tap: capture a serving engine's hidden states and train EAGLE-3 drafters on them."""

__version__ = "0.1.0"

"""Real torch modules for the model families' units, built from the ModelSpec's dimensions."""

"""Ray actors: thin wrappers that join the model's engines to the store."""

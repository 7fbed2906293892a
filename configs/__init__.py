"""The recipes: one `get_config() -> Config` per file (installed as `jaxformer.configs`)."""

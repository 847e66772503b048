"""The fedlmc ServerApp (``server.app:app``): a federation driven by ``run_config``."""

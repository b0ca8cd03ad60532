"""The built-in configs: YAML files, installed with specdec as the package specdec_cli.configs."""

"""The run configurations shipped with meshtron, installed as the package ``meshtron.mesh_configs``.

Only the YAML files matter; this file makes the directory a regular package so that setuptools'
editable installs can map it (see pyproject.toml and ``meshtron.bundled_configs``).
"""

"""hookexp's Hydra config tree, shipped inside the package as ``hookexp.conf``.

Importing it (Hydra does, for ``pkg://hookexp.conf``) registers the structured-config schema that
``config.yaml`` lists first, so the compose API works without importing the CLI.
"""

from hookexp.config import register_configs

register_configs()

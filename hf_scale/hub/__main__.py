"""``python -m hf_scale.hub FOLDER REPO_ID [...]``: the same as ``hf-scale push``."""

import sys

from .push_command import main

sys.exit(main())

"""JupyterLab server settings for `make lab` (found through JUPYTER_CONFIG_PATH, which adds
this directory to Jupyter's config path without replacing the user's own config).

Saving a lesson notebook from the lab writes it without outputs, execution counts or widget
state, the same result as `make strip` (`nbstripout --keep-id`). Autosave therefore never
dirties the tracked notebooks, and a reopened notebook shows no stale widget views ("model
not found") before its cells run again. Notebooks outside the repository's notebooks/
directory are saved as they are.
"""

import os
import warnings

_NOTEBOOKS = os.path.realpath(os.path.join(os.path.dirname(__file__), os.pardir, "notebooks"))
# The metadata nbstripout drops by default.
_NB_KEYS = ("signature", "widgets")
_CELL_KEYS = ("collapsed", "ExecuteTime", "execution", "heading_collapsed", "hidden", "scrolled")


def strip_notebook(nb: dict) -> dict:
    """Drop outputs, execution counts and volatile metadata from a notebook dict, in place."""
    for key in _NB_KEYS:
        nb.get("metadata", {}).pop(key, None)
    for cell in nb.get("cells", []):
        if "outputs" in cell:
            cell["outputs"] = []
        if "execution_count" in cell:
            cell["execution_count"] = None
        for key in _CELL_KEYS:
            cell.get("metadata", {}).pop(key, None)
    return nb


def strip_lesson_outputs(model, path, contents_manager, **kwargs):
    """ContentsManager.pre_save_hook: strip notebooks that live under notebooks/."""
    if model.get("type") != "notebook" or not isinstance(model.get("content"), dict):
        return
    root = getattr(contents_manager, "root_dir", None)
    if root is None:
        return
    os_path = os.path.realpath(os.path.join(root, path.strip("/")))
    if os.path.commonpath([os_path, _NOTEBOOKS]) == _NOTEBOOKS:
        strip_notebook(model["content"])


# traitlets applies a config twice to the contents manager; the second time the validator
# warns that the hook "overrides" itself.
warnings.filterwarnings("ignore", message="Overriding existing pre_save_hook")
c = get_config()  # noqa: F821 (defined by traitlets when it loads this file)
c.ContentsManager.pre_save_hook = strip_lesson_outputs

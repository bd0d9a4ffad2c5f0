"""Where a command's report goes: checked before any work, so that a report that cannot be written is a usage
error at once rather than a failure after the run (`mla-bench --json`, `mla-verify --json / --plot`,
`mla-verify model --json`)."""

import os


def unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written (its folder is missing or read-only, or it is a folder), or None."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a folder"
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"folder {folder} is not writable"
    return None

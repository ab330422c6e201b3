"""HuggingFace interop entry points: `import_hf` and `export_hf` (the command line is
`birkhoff import-hf` / `birkhoff export-hf` in birkhoff/cli/hf.py)."""

from __future__ import annotations

from birkhoff.interop.hf_export import export_hf
from birkhoff.interop.hf_import import import_hf

__all__ = ["export_hf", "import_hf"]

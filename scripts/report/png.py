"""Plots saved small: every results plot is a 256-colour palette PNG.

Why: the device tool carries the whole working tree with the offline bundle's second part (52 MiB of its
64), and the results folder's matplotlib PNGs (RGBA, about 120 KB each) had grown to 7 MB of it; a
palette keeps a plot's few colours and its anti-aliased edges to the eye at about a third of the size.

    python -m scripts.report.png FILE.png ...   re-encodes stored plots in place (already palette: unchanged)
"""

from __future__ import annotations

import sys
from pathlib import Path


def compact(path: Path) -> bool:
    """Re-encode the PNG at ``path`` as an optimized palette PNG; True if it was rewritten."""
    from PIL import Image

    with Image.open(path) as im:
        if im.mode == "P":
            return False
        pal = im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    pal.save(path, format="PNG", optimize=True)
    return True


def save(fig, path: Path, dpi: int = 110) -> None:
    """``fig.savefig`` at ``dpi``, then :func:`compact`."""
    fig.savefig(path, dpi=dpi)
    compact(Path(path))


if __name__ == "__main__":
    done = [p for p in map(Path, sys.argv[1:]) if compact(p)]
    print(f"re-encoded {len(done)} of {len(sys.argv) - 1} files")

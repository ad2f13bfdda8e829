"""``python -m scripts.report [--parts DIR ...]``: see the package docstring."""

from __future__ import annotations

import argparse

from . import kernels, pages


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Regenerate docs/results.md and the README's generated blocks.")
    ap.add_argument("--parts", nargs="*", default=[], help="folders of kernel benchmark parts to merge first")
    args = ap.parse_args(argv)
    kernels.merge(args.parts)
    pages.write_all()
    print(f"wrote {pages.RESULTS_PAGE.relative_to(pages.ROOT)} and the README's generated blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

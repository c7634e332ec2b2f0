"""The data path as docs/data.md describes it: its Python examples run on the chat example's
files, and dataflow-data refuses what it says with exit 2 and one line that names the record and
a way out."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dataflow.cli.data import main as data_main

ROOT = Path(__file__).resolve().parents[2]


def test_data_docs_python_examples_run_on_the_chat_examples_files(tmp_path, monkeypatch):
    """docs/data.md's Python blocks (open_data; tokenise + PackedCorpus into Engine.train_step)
    run as written in a folder where examples/chat_finetune.py wrote runs/chat."""
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    monkeypatch.syspath_prepend(str(ROOT))  # examples/ is not a package of the install
    from examples.chat_finetune import main

    monkeypatch.chdir(tmp_path)
    main(["runs/chat"])
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "data.md").read_text(), re.S)
    assert len(blocks) == 2
    for block in blocks:
        scope = {"__name__": "data_md"}
        exec(compile(block, "docs/data.md", "exec"), scope)
    assert scope["position"]["kind"] == "corpus" and scope["position"]["record"] > 0


def test_chat_records_under_the_byte_tokenizer_are_refused_naming_the_tokenizer_not_a_template(
        tmp_path, capsys):
    """A zoo (byte-level) model given chat records: exit 2 saying a model's tokenizer is needed,
    not to pass --chat-template (with one, bytes still could not render chat)."""
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "yo"}]}) + "\n")
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for extra in ([], ["--chat-template", str(template)]):
        capsys.readouterr()
        assert data_main(["tiny", str(chats), *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{chats}:1" in err, err
        assert "needs a model's tokenizer" in err and "--chat-template" not in err, err

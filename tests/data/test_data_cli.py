"""dataflow-data as docs/data.md describes it: what it refuses, with exit 2 and one line that
names the record and a way out."""

from __future__ import annotations

import json

from dataflow.cli.data import main as data_main


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

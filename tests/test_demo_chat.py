"""The shipped demo target has a chat template, so README's `client.chat.completions.create(...)` works out of the
box with the demo pair (it answered 400 "no chat template" before)."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import MODELS, demo_available
from specrelay.edge_worker.http.api import ChatRequest, chat_prompt_ids, parse

pytestmark = [pytest.mark.demo, pytest.mark.skipif(not demo_available(), reason="demo models not trained")]


@pytest.mark.parametrize("name", ["demo-target", "demo-draft"])
def test_demo_tokenizers_render_a_chat(name):
    tok = AutoTokenizer.from_pretrained(MODELS / name)
    body = b'{"model": "specrelay", "messages": [{"role": "user", "content": "Write a function\\nthat adds"}]}'
    req = parse(body, ChatRequest)
    ids = chat_prompt_ids(tok, req)
    assert tok.decode(ids) == "# user: Write a function\n# that adds\n# assistant:\n"

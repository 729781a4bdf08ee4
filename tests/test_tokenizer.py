"""The torch-free tokenizer against transformers' own, on the default model's files.

``FastTokenizer`` (tokenizers + transformers' Jinja renderer) must give exactly what
``AutoTokenizer`` gives: ids with and without special tokens, decoded text with and without
special tokens skipped, chat prompts, EOS ids and vocabulary size. The API process and the
detokenizer use it, so a difference here would be a difference between the server and the
offline reference.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from lockgate.checkpoint.loader import prepare_model_dir
from lockgate.tokenizer.tokenizer import FastTokenizer, load_tokenizer

TEXTS = ["", "Hello, world!", "  leading and trailing spaces  ", "tabs\tand\nnewlines\r\n\n", "café naïve 日本語 🙂👍🏽",
         "<|im_start|>user\nhi<|im_end|>", "<|endoftext|> special in text", "def f(x):\n    return x ** 2  # sq",
         "1234567890 3.14159 -42 1e-9", "a" * 300, "The quick brown fox " * 20, "\u200b zero width \ufeff bom",
         "ǅ ﬁ ẞ Ω ℌ", "emoji family 👨‍👩‍👧‍👦 flags 🇫🇷"]
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about café."}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaces  "}],
]


@pytest.fixture(scope="module")
def pair():
    from transformers import AutoTokenizer

    d = prepare_model_dir("default")
    ours = load_tokenizer("default", d)
    return ours, AutoTokenizer.from_pretrained(str(d), local_files_only=True)


def test_default_model_gets_the_torch_free_tokenizer(pair) -> None:
    ours, ref = pair
    assert isinstance(ours, FastTokenizer)
    assert ours.eos_token_ids == (ref.eos_token_id,) and ours.vocab_size == len(ref)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(pair, text) -> None:
    ours, ref = pair
    for special in (True, False):
        assert ours.encode(text, special) == list(ref.encode(text, add_special_tokens=special))


def test_decode_matches_transformers(pair) -> None:
    ours, ref = pair
    rng = np.random.default_rng(0)
    specials = [ref.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    for n in (1, 2, 5, 17, 64):
        for _ in range(20):
            ids = rng.integers(0, len(ref), size=n).tolist()
            ids[int(rng.integers(0, n))] = specials[int(rng.integers(0, 3))]
            for skip in (True, False):
                assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip), ids
    for text in TEXTS:
        ids = ref.encode(text)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_matches_transformers(pair, chat) -> None:
    ours, ref = pair
    for gen in (True, False):
        assert ours.apply_chat_template(chat, gen) == ref.apply_chat_template(chat, tokenize=False,
                                                                              add_generation_prompt=gen)


def test_a_given_chat_template_replaces_the_models_own(pair) -> None:
    """--chat-template on the default model: both tokenizer kinds render the given template as
    transformers renders it when handed the same template (its bos/eos names included)."""
    from lockgate.tokenizer.tokenizer import HFTokenizer

    _, ref = pair
    template = "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
    d = prepare_model_dir("default")
    fast = load_tokenizer("default", d, template)
    hf = HFTokenizer(d)
    hf.tok.chat_template = template
    for chat in CHATS:
        want = ref.apply_chat_template(chat, tokenize=False, chat_template=template)
        assert fast.apply_chat_template(chat) == want == hf.apply_chat_template(chat)
        assert want != ref.apply_chat_template(chat, tokenize=False)  # not the model's own


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter (offline), which must exit 0."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def test_loading_and_using_it_imports_no_torch() -> None:
    code = ("import sys\nfrom lockgate.checkpoint.loader import prepare_model_dir\n"
            "from lockgate.tokenizer.tokenizer import load_tokenizer\n"
            "t = load_tokenizer('default', prepare_model_dir('default'))\n"
            "t.decode(t.encode('hi')); t.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    _python(code)


def test_warm_up_renders_the_template_once_before_any_request() -> None:
    """The API process warms its tokenizer before it reports ready: the renderer is imported and the
    template compiled then, not inside the first chat request; a template that refuses the warm-up
    chat does not stop the start (a real request shows its error)."""
    code = ("import sys\nfrom lockgate.checkpoint.loader import prepare_model_dir\n"
            "from lockgate.tokenizer.tokenizer import load_tokenizer, warm_up\n"
            "t = load_tokenizer('default', prepare_model_dir('default'))\n"
            "name = 'transformers.utils.chat_template_utils'; before = name in sys.modules\n"
            "warm_up(t); m = sys.modules[name]\n"
            "compiled = m._compile_jinja_template.cache_info().currsize\n"
            "t.template = \"{{ raise_exception('no system message') }}\"; warm_up(t)\n"
            "print(before, compiled)\n")
    assert _python(code).stdout.split() == ["False", "1"]

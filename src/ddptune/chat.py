"""Chat templates and loss masks: conversations rendered prefix by prefix, checked, tokenized and cut.

A conversation (formats.py) is rendered through the tokenizer's chat template (a plain built-in one
when it has none). Its assistant spans come from the template itself, never from searching the text:
assistant turn k begins where the turns before it, rendered with the generation prompt, end, and
ends where the turns through it end, so the span holds the turn's text and its end-of-turn token.
`pieces` cuts the whole rendering at those points, each piece trained or not, and refuses (one line,
`TemplateProblem`) a span that is empty, a mask that would cover every token, and a prefix that does
not render as the beginning of the whole. Each piece is tokenized on its own; a conversation longer
than data.max_length keeps its final assistant turn whole and loses its earliest tokens (`tokenize`).
"""
from __future__ import annotations

from ddptune import tokens
from ddptune.tokens import IGNORE, last_ids

# For tokenizers without a chat template (the presets' byte tokenizer): turns under a header each,
# an assistant's ended by the end-of-sequence token.
PLAIN_CHAT = ("{{ bos_token }}{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
              "{{ '### ' + m['role'] | capitalize + ':\\n' + m['content'] }}{% if m['role'] == 'assistant' %}"
              "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '\\n\\n### Assistant:\\n' }}{% endif %}")
PROBE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Bye."}]


class TemplateProblem(ValueError):
    """A conversation the chat template cannot give a loss mask for; the message says why and the fix."""


def name_of(tokenizer) -> str:
    """The template, as a refusal names it."""
    if not getattr(tokenizer, "chat_template", None):
        return "ddptune's plain chat template (the tokenizer has none)"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """The text of `messages` as the chat template writes it."""
    from jinja2 import TemplateError

    template = None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as e:  # the template's own raise_exception (roles that must alternate...)
        raise TemplateProblem(f"{name_of(tokenizer)} refuses it ({' '.join(str(e).split())[:160]}; "
                              "change the row, or the template through model.tokenizer)") from None


def pieces(tokenizer, messages: list[dict], loss_on: str = "assistant") -> list[tuple[str, bool]]:
    """The rendered conversation up to its last assistant turn, as (text, trained) pieces that
    alternate: context, assistant turn, context, ..., the last assistant turn. `loss_on`:
    "assistant" trains every assistant turn, "last_assistant" the last one only."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    turns = messages[:last + 1]
    trained = [i for i, m in enumerate(turns) if m["role"] == "assistant"]
    trained = trained[-1:] if loss_on == "last_assistant" else trained
    whole = render(tokenizer, turns, False)
    out, pos = [], 0
    for i in trained:
        start = len(head := render(tokenizer, turns[:i], True))
        if start == 0:
            raise TemplateProblem(f"{name_of(tokenizer)} renders nothing before the first assistant turn, so the loss "
                                  "mask would cover every token (use a template that writes the user's turns, through model.tokenizer)")
        end = len(whole) if i == last else len(through := render(tokenizer, turns[:i + 1], False))
        if not (whole.startswith(head) and start >= pos and (i == last or whole.startswith(through))):
            fix = "use another template through model.tokenizer" if loss_on == "last_assistant" else \
                "set data.loss_on=last_assistant, or use another template through model.tokenizer"
            raise TemplateProblem(f"{name_of(tokenizer)} renders the turns before turn {i} as text that does not "
                                  f"begin the whole conversation (it rewrites earlier turns), so the assistant spans "
                                  f"cannot be found ({fix})")
        if end <= start:
            raise TemplateProblem(f"{name_of(tokenizer)} renders assistant turn {i} as nothing, so the loss mask "
                                  "would be empty (use a template that writes the assistant's text, through model.tokenizer)")
        out += [(whole[pos:start], False), (whole[start:end], True)]
        pos = end
    return out


def template_problem(tokenizer, loss_on: str) -> str | None:
    """What keeps the template from masking any conversation (a two-exchange probe), or None: a
    generation prompt that adds nothing (the assistant's header would be trained, and prompts for
    generation would lack it), or anything `pieces` refuses."""
    probe = PROBE[:1]
    try:
        if render(tokenizer, probe, True) == render(tokenizer, probe, False):
            return (f"{name_of(tokenizer)} adds nothing for add_generation_prompt, so the assistant's header would "
                    "be trained and prompts would lack it (use a template with a generation prompt, through model.tokenizer)")
        pieces(tokenizer, PROBE, loss_on)
    except TemplateProblem as e:
        return str(e)
    return None


def tokenize(tokenizer, parts: list[tuple[str, bool]], max_length: int) -> dict | None:
    """input_ids and labels (IGNORE where untrained) of a conversation's pieces, each tokenized on its
    own. Too long, it keeps its final assistant turn whole and the latest tokens of what comes before
    (`"cut": True`); None (dropped) when that turn alone leaves no room for one token before it."""
    return tokenize_many(tokenizer, [parts], max_length)[0]


def tokenize_many(tokenizer, conversations: list[list[tuple[str, bool]]], max_length: int) -> list[dict | None]:
    """`tokenize` of each conversation: the pieces of those short enough in one call to the tokenizer,
    of each longer one only as much as can be kept (tokens.first_ids, last_ids)."""
    limit = tokens.bound(tokenizer, max_length)
    short = [sum(len(text) for text, _ in parts) <= limit for parts in conversations]
    flat = iter(tokens.many_ids(tokenizer, [text for parts, s in zip(conversations, short) if s for text, _ in parts]))
    return [_fit(tokenizer, parts, [next(flat) for _ in parts] if s else None, max_length)
            for parts, s in zip(conversations, short)]


def _fit(tokenizer, parts: list[tuple[str, bool]], got: list[list[int]] | None, max_length: int) -> dict | None:
    """The example of a conversation's pieces, from their ids (`got`) or, if None, from their ends."""
    texts = [text for text, _ in parts]
    answer = got[-1] if got else tokens.first_ids(tokenizer, texts[-1], max_length)
    if len(answer) >= max_length:
        return None
    room, ids, labels, cut = max_length - len(answer), [], [], False
    for k in range(len(parts) - 2, -1, -1):
        if room == 0:
            cut = any(texts[:k + 1])
            break
        piece = got[k][-(room + 1):] if got else last_ids(tokenizer, texts[k], room + 1)
        if len(piece) > room:
            piece, cut = piece[1:], True
        ids[:0] = piece
        labels[:0] = piece if parts[k][1] else [IGNORE] * len(piece)
        room -= len(piece)
    ids, labels = ids + answer, labels + answer
    example = {"input_ids": ids, "labels": labels, "prompt_len": next(i for i, t in enumerate(labels) if t != IGNORE)}
    if cut:
        example["cut"] = True
    return example


def prompt_ids(tokenizer, context: list[dict], loss_on: str, max_length: int) -> list[int]:
    """The tokens that lead to an assistant reply after `context` (which ends with a user turn): the
    pieces training tokenizes before a final assistant turn, its header included; at most
    max_length - 1 tokens, the earliest cut."""
    parts = pieces(tokenizer, context + [{"role": "assistant", "content": "."}], loss_on)[:-1]
    out, room = [], max_length - 1
    for text, _ in reversed(parts):
        got = last_ids(tokenizer, text, room)
        out[:0] = got
        room -= len(got)
        if room <= 0:
            break
    return out


def end_of_turn(tokenizer) -> str:
    """What the template writes after an assistant's text (its end-of-turn token and what follows)."""
    head = render(tokenizer, PROBE[:1], True)
    return render(tokenizer, PROBE[:2], False)[len(head) + len(PROBE[1]["content"]):]

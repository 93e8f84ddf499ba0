"""Chat templates and loss masks: conversations rendered prefix by prefix, checked, tokenized and cut.

A conversation (formats.py) is rendered through the tokenizer's chat template (a plain built-in one
when it has none). Its assistant spans come from the template itself, never from searching the text:
assistant turn k begins where the turns before it, rendered with the generation prompt, end, and
ends where the turns through it end, so the span holds the turn's text and its end-of-turn token.
`pieces` cuts the whole rendering at those points, each piece trained or not, and refuses (one line,
`TemplateProblem`) a span that is empty, a mask that would cover every token, and a prefix that does
not render as the beginning of the whole. Each piece is tokenized on its own. A conversation longer
than data.max_length keeps its system turn and final assistant turn whole and is cut inside its user
turns, the longest before the last first, each losing its latest tokens (its beginning, where an
instruction stands, stays); where that is not enough, or the turns' text cannot be found in the
rendering, it loses its earliest tokens instead (`tokenize`). data.chat_template replaces the tokenizer's
template, and data.template=none renders a prompt and its completion as plain text (`use_template`).
"""
from __future__ import annotations

from pathlib import Path

from ddptune.data import tokens
from ddptune.config import ConfigError, is_template_path
from ddptune.data.tokens import IGNORE, last_ids

# For tokenizers without a chat template (the presets' byte tokenizer): turns under a header each,
# an assistant's ended by the end-of-sequence token.
PLAIN_CHAT = ("{{ bos_token }}{% for m in messages %}{% if not loop.first %}{{ '\\n\\n' }}{% endif %}"
              "{{ '### ' + m['role'] | capitalize + ':\\n' + m['content'] }}{% if m['role'] == 'assistant' %}"
              "{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '\\n\\n### Assistant:\\n' }}{% endif %}")
# data.template=none: a prompt and its completion as plain text, the completion ended by the eos token (and the
# whole begun by the bos token where the tokenizer adds one: use_template); nothing for add_generation_prompt.
PLAIN_TEXT = ("{% if messages | length > 2 or messages[0]['role'] != 'user' %}{{ raise_exception('data.template=none "
              "takes prompt_completion rows only: a prompt and its completion') }}{% endif %}"
              "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
PROBE = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
         {"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "Bye."}]


class TemplateProblem(ValueError):
    """A conversation the chat template cannot give a loss mask for; the message says why and the fix."""


def use_template(tokenizer, d) -> None:
    """Make data.chat_template (its text, or its .jinja file's) the tokenizer's chat template, or for
    data.template=none the plain text one (PLAIN_TEXT); with neither, the tokenizer keeps its own."""
    if d.template == "none":
        starts = tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]
        tokenizer.chat_template = ("{{ bos_token }}" if starts and tokenizer.bos_token_id is not None else "") + PLAIN_TEXT
    elif d.chat_template is not None and is_template_path(d.chat_template):
        try:
            tokenizer.chat_template = Path(d.chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError([f"data.chat_template: cannot read {d.chat_template} ({type(e).__name__}) "
                               "(give a readable UTF-8 .jinja file)"]) from None
    elif d.chat_template is not None:
        tokenizer.chat_template = d.chat_template


def name_of(tokenizer) -> str:
    """The template, as a refusal names it."""
    if not getattr(tokenizer, "chat_template", None):
        return "ddptune's plain chat template (the tokenizer has none)"
    return f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the tokenizer'}"


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    """The text of `messages` as the chat template writes it; TemplateProblem for anything rendering
    raises: Jinja's own errors (the template's raise_exception, the sandbox refusing an attribute) and
    the Python errors a template can cause (1 // 0, an include with no loader, a range past the sandbox's
    limit, a macro that calls itself), so that each is one line naming the template, never a traceback."""
    from jinja2 import TemplateError

    template = None if getattr(tokenizer, "chat_template", None) else PLAIN_CHAT
    try:
        return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except TemplateError as e:  # the template's own raise_exception (roles that must alternate...)
        raise TemplateProblem(f"{name_of(tokenizer)} refuses it ({' '.join(str(e).split())[:160]}; "
                              "change the row, or the template through data.chat_template)") from None
    except Exception as e:  # noqa: BLE001 - whatever the template's code raised
        raise TemplateProblem(f"{name_of(tokenizer)} fails to render it ({type(e).__name__}: {' '.join(str(e).split())[:160]}; "
                              "fix the template, or give another through data.chat_template)") from None


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
                                  "mask would cover every token (use a template that writes the user's turns, through data.chat_template)")
        end = len(whole) if i == last else len(through := render(tokenizer, turns[:i + 1], False))
        if not (whole.startswith(head) and start >= pos and (i == last or whole.startswith(through))):
            fix = "use another template through data.chat_template" if loss_on == "last_assistant" else \
                "set data.loss_on=last_assistant, or use another template through data.chat_template"
            raise TemplateProblem(f"{name_of(tokenizer)} renders the turns before turn {i} as text that does not "
                                  f"begin the whole conversation (it rewrites earlier turns), so the assistant spans "
                                  f"cannot be found ({fix})")
        if end <= start:
            raise TemplateProblem(f"{name_of(tokenizer)} renders assistant turn {i} as nothing, so the loss mask "
                                  "would be empty (use a template that writes the assistant's text, through data.chat_template)")
        out += [(whole[pos:start], False), (whole[start:end], True)]
        pos = end
    return out


def template_problem(tokenizer, loss_on: str, plain: bool = False) -> str | None:
    """What keeps the template from masking any conversation (a two-exchange probe), or None: a
    generation prompt that adds nothing (the assistant's header would be trained, and prompts for
    generation would lack it), or anything `pieces` refuses. `plain` (data.template=none): one
    exchange, which has no header."""
    probe = PROBE[:1]
    try:
        if not plain and render(tokenizer, probe, True) == render(tokenizer, probe, False):
            return (f"{name_of(tokenizer)} adds nothing for add_generation_prompt, so the assistant's header would "
                    "be trained and prompts would lack it (use a template with a generation prompt, through data.chat_template)")
        pieces(tokenizer, PROBE[:2] if plain else PROBE, loss_on)
    except TemplateProblem as e:
        return str(e)
    return None


def tokenize(tokenizer, parts: list[tuple[str, bool]], max_length: int, messages: list[dict] | None = None) -> dict | None:
    """input_ids and labels (IGNORE where untrained) of a conversation's pieces, each tokenized on its
    own. Too long, it keeps its final assistant turn whole and is cut inside its user turns (given
    its `messages`; `"cut": "user"`) or else loses its earliest tokens (`"cut": "earliest"`); None
    (dropped) when that turn alone leaves no room for one token before it."""
    return tokenize_many(tokenizer, [parts], max_length, [messages])[0]


def tokenize_many(tokenizer, conversations: list[list[tuple[str, bool]]], max_length: int,
                  messages: list[list[dict] | None] | None = None) -> list[dict | None]:
    """`tokenize` of each conversation: the pieces of those short enough in one call to the tokenizer,
    of each longer one only as much as can be kept (tokens.first_ids, last_ids)."""
    limit = tokens.bound(tokenizer, max_length)
    short = [sum(len(text) for text, _ in parts) <= limit for parts in conversations]
    flat = iter(tokens.many_ids(tokenizer, [text for parts, s in zip(conversations, short) if s for text, _ in parts]))
    out = []
    for parts, s, turns in zip(conversations, short, messages or [None] * len(conversations)):
        got = [next(flat) for _ in parts] if s else None
        if got is not None and sum(map(len, got)) <= max_length:
            out.append(_fit(tokenizer, parts, got, max_length))
        else:
            out.append((turns and in_user_turns(tokenizer, parts, turns, max_length)) or _fit(tokenizer, parts, got, max_length))
    return out


def in_user_turns(tokenizer, parts: list[tuple[str, bool]], messages: list[dict], max_length: int) -> dict | None:
    """The example of an over-long conversation cut inside its user turns: the longest user turn
    before the last first, the last one only after them, each keeping its first tokens, until it
    fits. None where that cannot make it fit (long assistant turns or headers), or where no user turn's
    text is found in the rendering: the caller then cuts the earliest tokens."""
    segments = _segments(parts, messages)
    if segments is None:
        return None
    got = tokens.firsts(tokenizer, [text for text, _, _ in segments],
                        [None if turn is None else max_length + 1 for _, _, turn in segments])
    excess = sum(map(len, got)) - max_length
    order = sorted((k for k, (_, _, turn) in enumerate(segments) if turn is not None),
                   key=lambda k: (segments[k][2], -len(got[k]), k))  # turns before the last first, longest first
    for k in order:
        if excess <= 0:
            break
        take = min(excess, len(got[k]))
        got[k], excess = got[k][:len(got[k]) - take], excess - take
    if excess > 0 or len(got[-1]) >= max_length:
        return None
    ids = [t for g in got for t in g]
    labels = [t for g, (_, trained, _) in zip(got, segments) for t in (g if trained else [IGNORE] * len(g))]
    return {"input_ids": ids, "labels": labels, "prompt_len": next(i for i, t in enumerate(labels) if t != IGNORE),
            "cut": "user"}


def _segments(parts: list[tuple[str, bool]], messages: list[dict]) -> list[tuple[str, bool, bool | None]] | None:
    """The pieces, each context piece split around the text of the user turns it holds: (text, trained,
    None, or for a user turn's text whether it is the last user turn). None when no user turn's text
    is found, in order, inside a context piece."""
    whole, spans, pos = "".join(text for text, _ in parts), [], 0
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    for i, m in enumerate(messages):
        text = m["content"].strip()
        at = whole.find(text, pos) if text else -1
        if at >= 0:
            pos = at + len(text)
            spans += [(at, pos, i == last_user)] if m["role"] == "user" else []
    out, start = [], 0
    for text, trained in parts:
        end, cursor = start + len(text), start
        for a, b, last in ([] if trained else [sp for sp in spans if start <= sp[0] and sp[1] <= end]):
            out += [(whole[cursor:a], False, None), (whole[a:b], False, last)]
            cursor = b
        out.append((whole[cursor:end], trained, None))
        start = end
    return [seg for seg in out if seg[0]] if any(seg[2] is not None for seg in out) else None


def _fit(tokenizer, parts: list[tuple[str, bool]], got: list[list[int]] | None, max_length: int) -> dict | None:
    """The example of a conversation's pieces, from their ids (`got`) or, if None, from their ends."""
    texts = [text for text, _ in parts]
    answer = got[-1] if got else tokens.first_ids(tokenizer, texts[-1], max_length)
    if len(answer) >= max_length:
        return None
    room, ids, labels, cut, trained_from = max_length - len(answer), [], [], False, 0
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
        if parts[k][1] and piece:  # the earliest trained piece so far begins this many tokens before the answer
            trained_from = len(ids)
    example = {"input_ids": ids + answer, "labels": labels + answer, "prompt_len": len(ids) - trained_from}
    if cut:
        example["cut"] = "earliest"
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

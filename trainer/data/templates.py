"""Chat templates by name, rendered the way LLaMA-Factory renders them.

A template is a set of slot lists (user, assistant, system, observation, prefix). A slot is a string
with ``{{content}}`` where the message goes, or the marker ``BOS`` or ``EOS`` (the tokenizer's bos / eos
id; a template that names stop words uses its first stop word as eos). Each string slot is tokenized on
its own, without special tokens added. Turn 0 starts with the prefix and (when there is a system message)
the system slot; templates marked ``fuse_system`` instead put the rendered system text in front of the
first user message (Llama 2, Mistral, Gemma).

``encode_turns`` returns one (prompt ids, response ids) pair per user/assistant turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tiermem.errors import ConfigError, nearest

BOS, EOS = "<<bos>>", "<<eos>>"


@dataclass
class Template:
    user: list
    assistant: list
    system: list
    observation: list | None = None
    prefix: list = field(default_factory=list)
    default_system: str = ""
    stop_words: list[str] = field(default_factory=list)  # the first replaces eos (LLaMA-Factory's replace_eos)
    fuse_system: bool = False


def _t(user=None, assistant=None, system=None, **kw) -> Template:
    user = user or ["{{content}}"]
    return Template(user=user, assistant=assistant or ["{{content}}", EOS], system=system or user, **kw)


_QWEN_USER = "<|im_start|>user\n{{content}}<|im_end|>\n<|im_start|>assistant\n"
_L3_USER = ("<|start_header_id|>user<|end_header_id|>\n\n{{content}}<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
_GEMMA_USER = "<start_of_turn>user\n{{content}}<end_of_turn>\n<start_of_turn>model\n"

TEMPLATES: dict[str, Template] = {
    "default": _t(user=["Human: {{content}}", EOS, "\nAssistant:"], assistant=["{{content}}", EOS, "\n"],
                  system=["System: {{content}}", EOS, "\n"]),
    "empty": _t(assistant=["{{content}}"]),
    "alpaca": _t(user=["### Instruction:\n{{content}}\n\n### Response:\n"], assistant=["{{content}}", EOS, "\n\n"],
                 default_system="Below is an instruction that describes a task. Write a response that "
                                "appropriately completes the request.\n\n"),
    "llama2": _t(user=[BOS, "[INST] {{content}} [/INST]"], system=["<<SYS>>\n{{content}}\n<</SYS>>\n\n"],
                 fuse_system=True),
    "llama3": _t(user=[_L3_USER], assistant=["{{content}}<|eot_id|>"],
                 system=["<|start_header_id|>system<|end_header_id|>\n\n{{content}}<|eot_id|>"],
                 observation=["<|start_header_id|>ipython<|end_header_id|>\n\n{{content}}<|eot_id|>"
                              "<|start_header_id|>assistant<|end_header_id|>\n\n"],
                 prefix=[BOS], stop_words=["<|eot_id|>", "<|eom_id|>"]),
    "mistral": _t(user=["[INST] {{content}}[/INST]"], assistant=[" {{content}}", EOS], system=["{{content}}\n\n"],
                  observation=['[TOOL_RESULTS] {"content": {{content}}}[/TOOL_RESULTS]'], prefix=[BOS],
                  fuse_system=True),
    "qwen": _t(user=[_QWEN_USER], assistant=["{{content}}<|im_end|>\n"],
               system=["<|im_start|>system\n{{content}}<|im_end|>\n"],
               observation=["<|im_start|>user\n<tool_response>\n{{content}}\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n"],
               default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant.",
               stop_words=["<|im_end|>"]),
    "gemma": _t(user=[_GEMMA_USER], assistant=["{{content}}<end_of_turn>\n"], system=["{{content}}\n\n"],
                observation=["<start_of_turn>tool\n{{content}}<end_of_turn>\n<start_of_turn>model\n"],
                prefix=[BOS], stop_words=["<end_of_turn>"], fuse_system=True),
}


def get_template(name: str | None) -> Template:
    if name not in TEMPLATES:
        raise ConfigError(f"template: unknown template '{name}'{nearest(str(name), list(TEMPLATES))}; templates are "
                          + ", ".join(TEMPLATES))
    return TEMPLATES[name]


def _fill(slots: list, content: str) -> list:
    return [s.replace("{{content}}", content) if isinstance(s, str) and s not in (BOS, EOS) else s for s in slots]


def eos_id(template: Template, tok) -> int:
    """The eos id under this template: its first stop word when it names one, else the tokenizer's."""
    if template.stop_words:
        tid = tok.backend.token_to_id(template.stop_words[0])
        if tid is None:
            raise ConfigError(f"the tokenizer has no token {template.stop_words[0]!r}, which this template ends "
                              "turns with; pick the template that matches the model")
        return tid
    return tok.eos_id


def _ids(slots: list, template: Template, tok) -> list[int]:
    out: list[int] = []
    for s in slots:
        if s == BOS:
            if tok.bos_id is not None:
                out.append(tok.bos_id)
        elif s == EOS:
            out.append(eos_id(template, tok))
        elif s:
            out += tok.encode(s)
    return out


def encode_turns(template: Template, tok, messages: list[dict], system: str | None
                 ) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) per turn of ``messages`` (alternating user/observation and assistant)."""
    system = system or template.default_system
    encoded = []
    for i, m in enumerate(messages):
        slots: list = []
        system_text = ""
        if i == 0:
            slots += template.prefix
            if system:
                if template.fuse_system:
                    system_text = _fill(template.system, system)[0]
                else:
                    slots += _fill(template.system, system)
        if m["role"] == "user":
            slots += _fill(template.user, system_text + m["content"])
        elif m["role"] == "observation":
            slots += _fill(template.observation or template.user, m["content"])
        else:
            slots += _fill(template.assistant, m["content"])
        encoded.append(_ids(slots, template, tok))
    return [(encoded[i], encoded[i + 1]) for i in range(0, len(encoded), 2)]

"""llama.cpp's built-in chat templates, by name (`llama_chat_apply_template`), for packages without one.

Many GGUF files carry no `tokenizer.chat_template` (the Gemma 3 270M of the
default `make run` model among them). llama.cpp ships the formats of the
common model families in C++ and selects them by name; the front uses them
when the package has no template, chosen from the GGUF's architecture
(`family_template`). No Jinja and no hand-written format here: the text is
llama.cpp's.
"""

from __future__ import annotations

import ctypes

from workers.llamacpp.binding import shim

# general.architecture -> llama.cpp's built-in template name, for the families whose architecture says
# which format their chat models use.
_BY_ARCHITECTURE = {
    "gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma", "gemma3n": "gemma",
    "qwen2": "chatml", "qwen3": "chatml", "qwen2moe": "chatml", "qwen3moe": "chatml",
    "phi3": "phi3", "phi4": "phi4", "command-r": "command-r", "exaone": "exaone3",
}
_ROLES = {"developer": "system"}  # roles the built-in formats know by another name


class _Message(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]


def _lib():
    lib = shim()  # libllama's symbols are loaded globally with the shim
    f = lib.llama_chat_apply_template
    f.restype = ctypes.c_int32
    f.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_bool, ctypes.c_char_p,
                  ctypes.c_int32]
    return f


def family_template(architecture: str | None) -> str | None:
    """The built-in template name for a GGUF architecture, or None when the family has no known format."""
    return _BY_ARCHITECTURE.get((architecture or "").lower())


def apply_builtin(name: str, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages` in llama.cpp's built-in format `name` (special tokens as text)."""
    apply = _lib()
    keep = [(_ROLES.get(m["role"], m["role"]).encode(), str(m.get("content") or "").encode()) for m in messages]
    arr = (_Message * max(1, len(keep)))(*[_Message(r, c) for r, c in keep])
    size = 2 * sum(len(r) + len(c) for r, c in keep) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = apply(name.encode(), arr, len(keep), add_generation_prompt, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp has no built-in chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8", errors="replace")
        size = n + 1
    raise ValueError("llama_chat_apply_template: the prompt did not fit")


class BuiltinChatTemplate:
    """ChatTemplate's interface (`render`) over a llama.cpp built-in format."""

    def __init__(self, name: str) -> None:
        apply_builtin(name, [{"role": "user", "content": "x"}])  # unknown names fail here, at load
        self.name = name
        self.source = f"llama.cpp built-in {name!r}"

    def render(self, messages: list[dict], add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        return apply_builtin(self.name, messages, add_generation_prompt)

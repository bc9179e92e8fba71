"""A small Dockerfile reader: enough to check the project's Dockerfile and to replay
its runtime stage outside Docker (no Docker engine runs where the tests run)."""

from __future__ import annotations

import json
import pathlib
import re
import shlex
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case) and the rest of its (joined) line."""

    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array of an exec-form ``CMD``/``ENTRYPOINT``/``VOLUME`` (or raise)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + len("CMD") :]
        value = json.loads(text)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args}")
        return value


@dataclass
class Stage:
    """One ``FROM`` stage."""

    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        """Every instruction of this kind, in order."""
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        """The effective (last) instruction of this kind."""
        found = self.all(keyword)
        if not found:
            raise KeyError(f"stage {self.name} has no {keyword}")
        return found[-1]

    def env(self) -> dict[str, str]:
        """The ``ENV`` values (``KEY=value`` form), later ones winning."""
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for word in shlex.split(instruction.args):
                key, sep, value = word.partition("=")
                if not sep:
                    raise ValueError(f"ENV must use KEY=value: {instruction.args}")
                values[key] = value
        return values

    def index(self, keyword: str, contains: str = "") -> int:
        """Position of the first instruction of this kind whose args contain ``contains``."""
        for n, instruction in enumerate(self.instructions):
            if instruction.keyword == keyword and contains in instruction.args:
                return n
        raise KeyError(f"stage {self.name} has no {keyword} with {contains!r}")


@dataclass
class Dockerfile:
    """A parsed Dockerfile: global ``ARG`` defaults and the stages."""

    args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        """The stage called ``name``."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    @property
    def final(self) -> Stage:
        """The stage ``docker build`` produces by default (the last one)."""
        return self.stages[-1]


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue  # comments (also inside continuations) and blank lines
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current.rstrip())
    return lines


def parse(path: pathlib.Path) -> Dockerfile:
    """Reads ``path`` (the parser directive line is a comment here)."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, flags=re.IGNORECASE)
            if match is None:
                raise ValueError(f"cannot read FROM {rest}")
            stages.append(Stage(base=match.group(1), name=match.group(2)))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{keyword} before the first FROM")
            name, _, default = rest.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, rest))
    return Dockerfile(args, stages)

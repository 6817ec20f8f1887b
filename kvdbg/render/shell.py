"""Shell commands printed to be copied: broken between words with a trailing backslash to fit the line."""

from __future__ import annotations

import shlex

from rich.text import Text


class ShellCommand:
    """One shell command after ``lead`` (``"   $ "``), broken between words with `` \\`` where it is wider than
    the line; a continuation lines up under the command, 4 further in (less where a long word would then pass
    the line's end), and a word longer than the line is shown whole: print with ``crop=False``, so that the
    command is copied whole."""

    def __init__(self, command: str, lead: str, style: str = "cyan"):
        self.command, self.lead, self.style = command, lead, style

    def __rich_console__(self, console, options):
        width = max(1, options.max_width - len(self.lead))
        for number, line in enumerate(shell_lines(self.command, width)):
            lead = self.lead if number == 0 else " " * continuation_indent(len(self.lead), line, options.max_width)
            yield Text(lead + line, style=self.style, no_wrap=True, overflow="ignore")


def continuation_indent(lead: int, line: str, max_width: int) -> int:
    """Where a continuation line of a command after a lead of ``lead`` columns begins: 4 further in than the
    command, less where the line (a long path) would then pass ``max_width``."""
    return max(0, min(lead + 4, max_width - len(line)))


def shell_lines(command: str, width: int) -> list[str]:
    """``command`` in lines of at most ``width`` (the first; later ones are indented 4 more), broken between
    words with a trailing `` \\``, so that pasted whole it is still one shell command. Only between the shell's
    own words (a quoted path with a space is one word); a command not written as ``shlex.join`` writes it is
    never broken."""
    try:
        words = [shlex.quote(word) for word in shlex.split(command)]
    except ValueError:  # an unbalanced quote: not a command to break
        return [command]
    if " ".join(words) != command:
        return [command]
    lines: list[str] = []
    line = ""
    for word in words:
        room = width - (4 if lines else 0) - 2  # the " \\" a broken line ends with
        if line and len(line) + 1 + len(word) > room:
            lines.append(line + " \\")
            line = word
        else:
            line = f"{line} {word}" if line else word
    lines.append(line)
    if len(lines) > 1 and len(" ".join(words)) <= width:
        return [command]
    return lines


__all__ = ["ShellCommand", "continuation_indent", "shell_lines"]

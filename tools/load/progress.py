"""The load tools' progress bar: one line on stderr over every request of a run (rich)."""

from __future__ import annotations


class Progress:
    """A rich progress bar on stderr over every request of the run (silent with --no-progress)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as RichProgress, TextColumn
            from rich.progress import TimeElapsedColumn

            self.bar = RichProgress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                    console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("bench", total=total, info="")
            self.bar.start()
        self.tokens = 0
        self.errors = 0

    def point(self, label: str) -> None:
        if self.bar:
            self.bar.update(self.task, description=label)

    def record(self, rec) -> None:
        self.tokens += rec.tokens
        self.errors += rec.error is not None
        if self.bar:
            self.bar.update(self.task, advance=1, info=f"{self.tokens} tok, {self.errors} err")

    def close(self) -> None:
        if self.bar:
            self.bar.stop()

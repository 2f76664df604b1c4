"""The Textual app behind ``xlaserve top``: one worker's models, live from its ``WatchStatus``
stream, and the control API's actions, each confirmed first and answered in the event log."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable

from grpclib.exceptions import GRPCError
from rich.text import Text  # DataTable's column labels are Rich text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.logging import TextualHandler
from textual.markup import escape
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Input, Label, Log, Sparkline, Static

from tui import connection
from tui.connection import Address
from tui.status import (COLUMNS, SORT_KEYS, ModelRow, WorkerView, cells, changes, derive,
                        human_bytes, human_seconds, visible)
from xlaserve._proto import xlaserve_control_pb2 as pb

# Samples the worker's sparkline keeps: two minutes at the default interval.
SPARKLINE_SAMPLES = 120
# Lines the event log keeps; older ones scroll away.
EVENT_LOG_LINES = 500

HELP = """\
[b]xlaserve top[/b]: one worker's models, from its WatchStatus stream.

q        quit                       ?       this help (any key closes it)
up/down  choose a model (the detail pane shows it)
s        sort by the next column    S       reverse the order
         (or click a column's heading)
/        filter by model name       escape  clear the filter
p        pin the model: SetModelResidency device
u        unpin it: residency system (on the device on demand)
w        its weight (SetModelPolicy; > 0)
b        its max_batch_size (0: uncapped)
h        its batch hold, batch_delay_seconds (0: off)
c        compact the worker's device memory (CompactMemory)

Each action asks first; the worker's answer goes to the event log.
rows/s, rows/exec, latency (the mean, receipt to answer), fail/s: over the
last update. cost: the learned cost of the largest batch size learned (1.2ms@8)."""


class HelpScreen(ModalScreen[None]):
    """The keys. Any key or a click closes it."""

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")

    def on_key(self) -> None:
        self.dismiss(None)

    def on_click(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question: ``y`` or enter confirms, ``n`` or escape declines."""

    BINDINGS = [Binding("y,enter", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, markup=False)
            with Horizontal(id="buttons"):
                yield Button("yes (y)", id="yes", variant="warning")
                yield Button("no (n)", id="no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class ValueScreen(ModalScreen["float | None"]):
    """Asks for one number; enter submits it once ``parse`` accepts it, escape cancels.
    ``parse`` raises ``ValueError`` with the message to show."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, question: str, current: str, parse: Callable[[str], float]) -> None:
        super().__init__()
        self.question, self.current, self.parse = question, current, parse

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, markup=False)
            yield Input(value=self.current, id="value")
            yield Label("enter: apply   escape: cancel", id="problem")

    @on(Input.Submitted)
    def submitted(self, event: Input.Submitted) -> None:
        try:
            value = self.parse(event.value)
        except ValueError as exc:
            self.query_one("#problem", Label).update(f"[red]{escape(str(exc))}[/red]")
            return
        self.dismiss(value)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _number(kind: type, at_least: float, positive: bool = False) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text.strip())
        except ValueError:
            raise ValueError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if positive and not value > 0:
            raise ValueError(f"must be > 0, got {text.strip()}")
        if value < at_least:
            raise ValueError(f"must be >= {at_least}, got {text.strip()}")
        return value
    return parse


class TopApp(App[None]):
    """``xlaserve top`` against the worker at ``address``, one snapshot every ``interval``
    seconds. ``max_backoff`` caps the wait between reconnects (tests shorten it).

    State an operator (or a test) can read: :attr:`connected`, :attr:`rows` (the latest rows,
    unfiltered), :attr:`worker` (the worker's line), :attr:`status_line` (the header's text),
    :attr:`events` (the event log's lines, newest last) and :attr:`last_answer` (the worker's
    answer to the last action). :meth:`wait_until` waits for the next change that makes a
    condition true."""

    CSS_PATH = "top.tcss"
    TITLE = "xlaserve top"
    BINDINGS = [
        Binding("q", "quit", "quit"),
        Binding("question_mark", "help", "help"),
        Binding("slash", "filter", "filter"),
        Binding("escape", "clear_filter", "clear filter", show=False),
        Binding("s", "sort", "sort"),
        Binding("S", "reverse", "reverse", show=False),
        Binding("p", "pin", "pin"),
        Binding("u", "unpin", "unpin"),
        Binding("w", "weight", "weight"),
        Binding("b", "max_batch_size", "max batch"),
        Binding("h", "hold", "hold"),
        Binding("c", "compact", "compact"),
    ]

    def __init__(self, address: Address, interval: float = 1.0,
                 max_backoff: float = connection.MAX_BACKOFF_SECONDS) -> None:
        super().__init__()
        self.address, self.interval, self.max_backoff = address, interval, max_backoff
        self.connected = False
        self.worker: WorkerView | None = None
        self.rows: tuple[ModelRow, ...] = ()
        self.events: deque[str] = deque(maxlen=EVENT_LOG_LINES)
        self.last_answer = ""
        self.status_line = f"connecting to {self.address}"
        self.sort_key, self.descending, self.name_filter = "name", False, ""
        self._throughput: deque[float] = deque(maxlen=SPARKLINE_SAMPLES)
        # The last snapshot seen, kept across a reconnect so that the event log then shows what
        # changed while disconnected rather than every model again.
        self._last: pb.ModelControlStatusResponse | None = None
        self._changed = asyncio.Condition()

    # ---- layout

    def compose(self) -> ComposeResult:
        yield Static(self.status_line, id="worker")
        yield DataTable(id="models", cursor_type="row", zebra_stripes=True)
        yield Sparkline([], id="throughput", summary_function=max)
        with Horizontal(id="bottom"):
            with VerticalScroll(id="detail-box"):
                yield Static("no model chosen", id="detail")
            yield Log(id="events", max_lines=EVENT_LOG_LINES)
        yield Input(placeholder="filter by model name; enter: keep, escape: clear", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        # Held, not queried: while a dialog is open, queries would search the dialog's screen.
        self._table = self.query_one("#models", DataTable)
        self._sparkline = self.query_one("#throughput", Sparkline)
        self._detail = self.query_one("#detail", Static)
        self._log = self.query_one("#events", Log)
        self._filter = self.query_one("#filter", Input)
        self._header = self.query_one("#worker", Static)
        table = self._table
        for key, heading in COLUMNS:
            table.add_column(heading, key=key)
        self._filter.display = False
        self._watch()

    # ---- the status stream

    @work(exclusive=True, group="watch")
    async def _watch(self) -> None:
        """Follow the worker's snapshots; on a lost connection show it and reconnect, waiting
        longer each time (up to ``max_backoff``), from the start again after a snapshot."""
        first_wait = min(connection.INITIAL_BACKOFF_SECONDS, self.max_backoff)
        delay = first_wait
        while True:
            previous, previous_at = None, 0.0
            try:
                async with contextlib.aclosing(connection.watch_status(self.address, self.interval)) as stream:
                    async for status in stream:
                        now = time.monotonic()
                        await self._show(status, previous, now - previous_at)
                        previous, previous_at = status, now
                        delay = first_wait
                reason = "the worker ended the stream (it is draining)"
            except GRPCError as exc:
                reason = f"{exc.status.name}: {exc.message or ''}"
            except connection.CONNECTION_ERRORS as exc:
                reason = str(exc) or type(exc).__name__
            await self._lost(reason, delay)
            await asyncio.sleep(delay)
            delay = min(connection.next_backoff(delay), self.max_backoff)

    async def _show(self, status: pb.ModelControlStatusResponse,
                    previous: pb.ModelControlStatusResponse | None, seconds: float) -> None:
        if not self.connected:
            self._log_event(f"connected to {self.address}")
        was_connected, self.connected = self.connected, True
        rows_before = self.rows
        self.worker, self.rows = derive(status, previous, seconds if previous is not None else None)
        for event in changes(status, previous if previous is not None else self._last):
            self._log_event(event.text)
        self._last = status
        if self.worker.rows_per_second is not None:
            self._throughput.append(self.worker.rows_per_second)
            # an idle worker's flat line would draw as full bars: draw nothing instead
            data = list(self._throughput) if max(self._throughput) > 0 else []
            if data or self._sparkline.data:
                self._sparkline.data = data
        self._render_worker()
        # an idle worker's snapshots are all alike: redraw only what changed, so that a
        # dashboard left open costs its terminal (and its SSH link) next to nothing
        if self.rows != rows_before or not was_connected:
            self._render_table()
        await self._notify_change()

    async def _lost(self, reason: str, retry_in: float) -> None:
        if self.connected:
            self._log_event(f"disconnected: {reason}")
        self.connected = False
        # reasons, names and answers come from the network: escaped, never read as markup
        self._set_header(f"[b red]disconnected[/b red] from {escape(str(self.address))}: {escape(reason)}; "
                     f"retrying in {retry_in:.1f} s")
        await self._notify_change()

    def _set_header(self, markup: str) -> None:
        plain = Content.from_markup(markup).plain
        if plain != self.status_line:
            self.status_line = plain
            self._header.update(markup)

    # ---- rendering

    def _render_worker(self) -> None:
        w = self.worker
        assert w is not None
        rate = "-" if w.rows_per_second is None else f"{w.rows_per_second:.1f}"
        # what matters first, so that an 80-column terminal cuts only the address
        self._set_header(
            f"[green]connected[/green] [b]{escape(w.worker)}[/b] {escape(w.backend)}  "
            f"budget {human_bytes(w.resident_bytes)} / {human_bytes(w.budget_bytes)}  "
            f"{rate} rows/s  {escape(str(self.address))}")

    def _render_table(self) -> None:
        table = self._table
        chosen = self._chosen_name()
        rows = visible(self.rows, self.name_filter, self.sort_key, self.descending)
        table.clear()
        for row in rows:
            table.add_row(*(escape(text) for text in cells(row)), key=row.name)
        names = [r.name for r in rows]
        if chosen in names:
            table.move_cursor(row=names.index(chosen), animate=False)
        for key, heading in COLUMNS:
            marker = (" v" if self.descending else " ^") if key == self.sort_key else ""
            table.columns[key].label = Text(heading + marker)  # type: ignore[index]
        self._render_detail()

    def _chosen_name(self) -> str | None:
        table = self._table
        if table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key((table.cursor_row, 0))
        return row_key.value

    def chosen(self) -> ModelRow | None:
        """The model under the table's cursor, from the latest snapshot."""
        name = self._chosen_name()
        return next((r for r in self.rows if r.name == name), None)

    def _render_detail(self) -> None:
        row = self.chosen()
        detail = self._detail
        if row is None:
            detail.update("no model chosen")
            return
        costs = ", ".join(f"{b}: {human_seconds(s)}" for b, s in row.learned_cost_seconds) or "none yet"
        if row.latency_seconds is None or row.queue_wait_seconds is None:
            latency = "nothing answered"
        else:
            latency = (f"mean latency {human_seconds(row.latency_seconds)} "
                       f"(queued {human_seconds(row.queue_wait_seconds)})")
        mix = ", ".join(f"{n}x{size}" for size, n in row.batch_mix) or "none"
        hold = (f"{human_seconds(row.batch_delay_seconds)} for "
                f"{row.batch_target_rows or 'the default'} rows" if row.batch_delay_seconds else "off")
        detail.update(
            f"[b]{escape(row.name)}[/b] {escape(row.state)} v{row.version}\n"
            + (f"reason: {escape(row.reason)}\n" if row.reason else "")
            + f"residency {escape(row.residency)}: {human_bytes(row.resident_bytes)} of "
              f"{human_bytes(row.weight_bytes)} on the device\n"
              f"queue {row.queue_depth}; weight {row.weight:g}; max_batch_size "
              f"{row.max_batch_size or 'uncapped'}\n"
              f"batch hold: {hold}\n"
              f"learned cost by batch size: {costs}\n"
              f"last update: {latency}; batch sizes run: {mix}\n"
              f"since start: {row.requests} rows in {row.executions} executions; "
              f"{row.successes} answered, {row.failures} failed")

    @on(DataTable.RowHighlighted)
    def _highlighted(self) -> None:
        self._render_detail()

    @on(DataTable.HeaderSelected)
    def _sort_by_heading(self, event: DataTable.HeaderSelected) -> None:
        key = event.column_key.value
        if key == self.sort_key:
            self.descending = not self.descending
        else:
            self.sort_key, self.descending = key, False
        self._render_table()

    def _log_event(self, text: str) -> None:
        line = f"{time.strftime('%H:%M:%S')} {text}"
        self.events.append(line)
        self._log.write_line(line)

    async def _notify_change(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checking it after each snapshot, connection change
        and answer (no polling). Bound it with ``asyncio.timeout``."""
        async with self._changed:
            await self._changed.wait_for(predicate)

    # ---- sorting and filtering

    def action_sort(self) -> None:
        self.sort_key = SORT_KEYS[(SORT_KEYS.index(self.sort_key) + 1) % len(SORT_KEYS)]
        self._render_table()

    def action_reverse(self) -> None:
        self.descending = not self.descending
        self._render_table()

    def action_filter(self) -> None:
        box = self._filter
        box.display = True
        box.focus()

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self.name_filter = event.value
        self._render_table()

    @on(Input.Submitted, "#filter")
    def _filter_kept(self) -> None:
        self._table.focus()

    def action_clear_filter(self) -> None:
        box = self._filter
        box.value, box.display = "", False
        self.name_filter = ""
        self._table.focus()
        self._render_table()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    # ---- actions: confirmed, sent, answered

    def _ask(self, question: str, method: str, request, done: str) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._send(method, request, done)
        self.push_screen(ConfirmScreen(question), answered)

    @work(group="actions")
    async def _send(self, method: str, request, done: str) -> None:
        try:
            response = await connection.call(self.address, method, request)
        except GRPCError as exc:
            answer = f"{method} refused: {exc.status.name}: {exc.message or ''}"
        except connection.CONNECTION_ERRORS as exc:
            answer = f"{method} failed: {exc or type(exc).__name__}"
        else:
            answer = f"{method}: {done}"
            if isinstance(response, pb.CompactMemoryResponse):
                answer += f": {response.message} ({human_bytes(response.freed_bytes)} freed)"
        self.last_answer = answer
        self._log_event(answer)
        failed = not answer.startswith(f"{method}: ")
        self.notify(answer, markup=False, severity="error" if failed else "information")
        await self._notify_change()

    def _model_or_say(self) -> ModelRow | None:
        row = self.chosen()
        if row is None:
            self.notify("no model chosen", severity="warning")
        return row

    def action_pin(self) -> None:
        if row := self._model_or_say():
            self._ask(f"Pin {row.name} on the device (residency device)?", "SetModelResidency",
                      pb.SetModelResidencyRequest(model=row.name, residency="device"),
                      f"{row.name} pinned (device)")

    def action_unpin(self) -> None:
        if row := self._model_or_say():
            self._ask(f"Unpin {row.name} (residency system: on the device on demand)?",
                      "SetModelResidency",
                      pb.SetModelResidencyRequest(model=row.name, residency="system"),
                      f"{row.name} unpinned (system)")

    def _policy(self, row: ModelRow, field: str, question: str, current: str,
                parse: Callable[[str], float]) -> None:
        def entered(value: float | None) -> None:
            if value is not None:
                self._ask(f"Set {row.name}'s {field} to {value:g}?", "SetModelPolicy",
                          pb.SetModelPolicyRequest(model=row.name, **{field: value}),
                          f"{row.name} {field} = {value:g}")
        self.push_screen(ValueScreen(question, current, parse), entered)

    def action_weight(self) -> None:
        if row := self._model_or_say():
            self._policy(row, "weight", f"{row.name}: weight (share of device time, > 0)",
                         f"{row.weight:g}", _number(float, 0.0, positive=True))

    def action_max_batch_size(self) -> None:
        if row := self._model_or_say():
            self._policy(row, "max_batch_size", f"{row.name}: max_batch_size (0: uncapped)",
                         str(row.max_batch_size), _number(int, 0))

    def action_hold(self) -> None:
        if row := self._model_or_say():
            self._policy(row, "batch_delay_seconds",
                         f"{row.name}: batch hold, batch_delay_seconds (0: off)",
                         f"{row.batch_delay_seconds:g}", _number(float, 0.0))

    def action_compact(self) -> None:
        self._ask("Compact the worker's device memory (CompactMemory)?", "CompactMemory",
                  pb.CompactMemoryRequest(), "done")


def run_top(address: Address, interval: float = 1.0) -> None:
    """Run the dashboard in this terminal until the operator quits. While it runs, log records go
    to Textual's log (``textual console``) rather than stderr, which would write over the screen;
    the dashboard shows connection problems itself."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers[:] = [TextualHandler()]
    try:
        TopApp(address, interval).run()
    finally:
        root.handlers[:] = saved

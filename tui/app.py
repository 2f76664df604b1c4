"""The Textual app behind ``xlaserve top``: a worker's models (a gateway's: every worker's,
labelled by worker), live from the ``WatchStatus`` stream, and the control API's actions, each
confirmed first and answered in the event log."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from grpclib.exceptions import GRPCError
from rich.text import Text  # DataTable's column labels are Rich text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.logging import TextualHandler
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Input, Label, Log, Sparkline, Static

from tui import connection
from tui.connection import Address
from tui.status import (COLUMNS, WORKER_COLUMN, ModelRow, WorkerView, cells, changes, derive,
                        hook_pools_text, human_bytes, human_duration, human_seconds, loads_text, share_text, spark,
                        visible)
from xlaserve._proto import grpc_service_pb2 as kpb
from xlaserve._proto import xlaserve_control_pb2 as pb
from xlaserve.controlchars import show_controls

# Samples the worker's sparkline keeps: two minutes at the default interval.
SPARKLINE_SAMPLES = 120
# Updates a model's own sparkline (in the detail pane) keeps: one line of a narrow pane.
MODEL_SPARK_SAMPLES = 30
# Lines the event log keeps; older ones scroll away.
EVENT_LOG_LINES = 500

HELP = """\
[b]xlaserve top[/b]: a worker's models (a gateway's: every worker's), from WatchStatus.

q        quit                       ?       this help (any key closes it)
up/down  choose a model (the detail pane shows it)
s        sort by the next column    S       reverse the order
         (or click a column's heading)
/        filter by model or worker  escape  clear the filter
p        pin the model: SetModelResidency device
u        unpin it: residency system (on the device on demand)
w        its weight (SetModelPolicy; > 0)
b        its max_batch_size (0: uncapped)
h        its batch hold, batch_delay_seconds (0: off)
l        load a model by name: RepositoryModelLoad (explicit mode)
x        unload the model: RepositoryModelUnload (explicit mode)
c        compact the worker's device memory (CompactMemory)

Each action asks first; the answer goes to the event log. Through a gateway,
p u w b h c go to the chosen row's worker; l and x to every worker.
Over the last update: rows/s, p50/p99 (receipt to answer, from the latency
buckets), rej/s (scheduler rejections), fail/s, rows/exec. share/wt: device
time it had / what its weight is due under fair. ld/ev: weight loads and
evictions since start, ! when both moved in the last update (thrashing).
miss/req: dispatches that waited for its weights per request answered.
evict#: its place in the order the cache would evict now (1: next to go).
cost: the learned cost of the largest batch size learned (1.2ms@8)."""


class HelpScreen(ModalScreen[None]):
    """The keys. Any key or a click closes it."""

    def compose(self) -> ComposeResult:
        yield Static(HELP, id="help")

    def on_key(self, event) -> None:
        # the key only closes the help: it must not go on to the dashboard's own bindings
        event.stop()
        event.prevent_default()
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


class ValueScreen(ModalScreen[object]):
    """Asks for one value (a number, a name); enter submits it once ``parse`` accepts it, escape
    cancels (``None``). ``parse`` raises ``ValueError`` with the message to show."""

    BINDINGS = [Binding("escape", "cancel", "cancel")]

    def __init__(self, question: str, current: str, parse: Callable[[str], object]) -> None:
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
            self.query_one("#problem", Label).update(Content.from_markup("[red]$problem[/red]", problem=str(exc)))
            return
        self.dismiss(value)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _model_name(text: str) -> str:
    name = text.strip()
    if not name:
        raise ValueError("a model name, as in the model repository")
    return name


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


@dataclass(frozen=True, slots=True)
class _Seen:
    """A worker's last snapshot and when it came (``time.monotonic()``)."""
    status: pb.ModelControlStatusResponse
    at: float


class TopApp(App[None]):
    """``xlaserve top`` against the worker (or gateway) at ``address``, one snapshot every
    ``interval`` seconds. ``max_backoff`` caps the wait between reconnects (tests shorten it).

    State an operator (or a test) can read: :attr:`connected`, :attr:`gateway` (the stream is a
    gateway's), :attr:`rows` (the latest rows of every worker, unfiltered), :attr:`worker_views` (each
    worker's line) and :attr:`worker` (the last one updated), :attr:`status_line` (the header's
    text), :attr:`events` (the event log's lines, newest last) and :attr:`last_answer` (the
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
        Binding("l", "load", "load"),
        Binding("x", "unload", "unload"),
        Binding("c", "compact", "compact"),
    ]
    # Rows from a worker silent this long (through a gateway) are marked stale in its line.
    STALE_UPDATES = 3

    def __init__(self, address: Address, interval: float = 1.0,
                 max_backoff: float = connection.MAX_BACKOFF_SECONDS, *,
                 source: Callable[[Address, float], AsyncIterator[pb.ModelControlStatusResponse]]
                 = connection.watch_status,
                 clock: Callable[[], float] = time.monotonic,
                 stamp: Callable[[], str] = lambda: time.strftime("%H:%M:%S")) -> None:
        """``source(address, interval)`` is the status stream (the worker's ``WatchStatus``);
        ``clock`` the seconds that rates are taken over and ``stamp`` the event log's time of day.
        Tests give fixed ones, so that a screenshot is the same every time."""
        super().__init__()
        self.address, self.interval, self.max_backoff = address, interval, max_backoff
        self._source, self._clock, self._stamp = source, clock, stamp
        self.connected = False
        self.gateway = False
        self.worker: WorkerView | None = None
        self.worker_views: dict[str, WorkerView] = {}
        self.rows: tuple[ModelRow, ...] = ()
        self._rows_of: dict[str, tuple[ModelRow, ...]] = {}
        self._seen: dict[str, _Seen] = {}
        self._worker_column = False
        self.events: deque[str] = deque(maxlen=EVENT_LOG_LINES)
        self.last_answer = ""
        self.status_line = f"connecting to {self.address}"
        self.sort_key, self.descending, self.name_filter = "name", False, ""
        self._throughput: deque[float] = deque(maxlen=SPARKLINE_SAMPLES)
        # each model's rows per second, the last MODEL_SPARK_SAMPLES updates, by table key
        self._model_rates: dict[str, deque[float]] = {}
        # Each worker's last snapshot, kept across a reconnect so that the event log then shows
        # what changed while disconnected rather than every model again.
        self._last: dict[str, pb.ModelControlStatusResponse] = {}
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
        self._add_columns()
        self._filter.display = False
        self._watch()

    def _columns(self) -> tuple[tuple[str, str], ...]:
        return ((WORKER_COLUMN,) if self._worker_column else ()) + COLUMNS

    def _add_columns(self) -> None:
        for key, heading in self._columns():
            self._table.add_column(heading, key=key)

    def on_resize(self, event) -> None:
        # a tall terminal gives the detail pane and the event log room for all their lines
        self.set_class(event.size.height >= 40, "-tall")

    # ---- the status stream

    @work(exclusive=True, group="watch")
    async def _watch(self) -> None:
        """Follow the worker's snapshots; on a lost connection show it and reconnect, waiting
        longer each time (up to ``max_backoff``), from the start again after a snapshot."""
        first_wait = min(connection.INITIAL_BACKOFF_SECONDS, self.max_backoff)
        delay = first_wait
        while True:
            self._seen = {}         # rates start again after a reconnect
            try:
                async with contextlib.aclosing(self._source(self.address, self.interval)) as stream:
                    async for message in stream:
                        now = self._clock()
                        if message.workers:
                            self.gateway = True
                        for status in (message.workers or [message]):
                            await self._show(status, now)
                        delay = first_wait
                reason = "the worker ended the stream (it is draining)"
            except GRPCError as exc:
                reason = f"{exc.status.name}: {exc.message or ''}"
            except connection.CONNECTION_ERRORS as exc:
                reason = str(exc) or type(exc).__name__
            await self._lost(reason, delay)
            await asyncio.sleep(delay)
            delay = min(connection.next_backoff(delay), self.max_backoff)

    async def _show(self, status: pb.ModelControlStatusResponse, now: float) -> None:
        """One worker's snapshot: its rows, its line, its events, the sparkline."""
        if not self.connected:
            self._log_event(f"connected to {self.address}" + (" (a gateway)" if self.gateway else ""))
        was_connected, self.connected = self.connected, True
        name = status.worker
        seen = self._seen.get(name)
        previous = seen.status if seen is not None else None
        view, rows = derive(status, previous, now - seen.at if seen is not None else None)
        self._seen[name] = _Seen(status, now)
        self.worker, self.worker_views[name] = view, view
        prefix = f"{name}: " if self.gateway else ""
        for event in changes(status, previous if previous is not None else self._last.get(name)):
            self._log_event(prefix + event.text)
        self._last[name] = status
        for row in rows:
            if row.rows_per_second is not None:
                key = self._key(row)
                rates = self._model_rates.get(key)
                if rates is None:
                    rates = self._model_rates[key] = deque(maxlen=MODEL_SPARK_SAMPLES)
                rates.append(row.rows_per_second)
        rows_changed = rows != self._rows_of.get(name)
        self._rows_of[name] = rows
        if rows_changed:
            self.rows = tuple(r for w in sorted(self._rows_of) for r in self._rows_of[w])
        # once a round: a gateway's workers each send one an update
        if view.rows_per_second is not None and name == min(self._seen):
            self._throughput.append(math.fsum(w.rows_per_second or 0.0 for w in self.worker_views.values()))
            # an idle worker's flat line would draw as full bars: draw nothing instead
            data = list(self._throughput) if max(self._throughput) > 0 else []
            if data or self._sparkline.data:
                self._sparkline.data = data
        self._render_worker(now)
        # an idle worker's snapshots are all alike: redraw only what changed, so that a
        # dashboard left open costs its terminal (and its SSH link) next to nothing
        if rows_changed or not was_connected:
            self._render_table()
        await self._notify_change()

    async def _lost(self, reason: str, retry_in: float) -> None:
        reason = show_controls(reason)      # a peer's error message: text, never a terminal escape
        if self.connected:
            self._log_event(f"disconnected: {reason}")
        self.connected = False
        # reasons, names and answers come from the network: template variables, never markup
        self._set_header(Content.from_markup(f"[b red]disconnected[/b red] from $address: $reason; "
                                             f"retrying in {retry_in:.1f} s", address=str(self.address),
                                             reason=reason))
        await self._notify_change()

    def _set_header(self, content: Content) -> None:
        if content.plain != self.status_line:
            self.status_line = content.plain
            self._header.update(content)

    # ---- rendering

    def _worker_text(self, w: WorkerView, now: float) -> Content:
        rate = "-" if w.rows_per_second is None else f"{w.rows_per_second:.1f}"
        cache = f"  cache {w.cache_hits}/{w.cache_lookups}" if w.cache_lookups else ""
        seen = self._seen.get(w.worker)
        silent = now - seen.at if seen is not None else 0.0
        stale = (f"  [b red]silent {silent:.0f} s[/b red]"
                 if silent > max(self.STALE_UPDATES * self.interval, 2.0) else "")
        # what matters first, so that an 80-column terminal cuts only the least useful end
        pools, saturated = hook_pools_text(w)
        if pools:       # hooks that hang hold their threads: named, in red once they starve the rest
            pools = f"  [b red]{pools}[/b red]" if saturated else f"  {pools}"
        return Content.from_markup(
            f"[b]$worker[/b] $backend $discipline{stale}  "
            f"budget {human_bytes(w.resident_bytes)} / {human_bytes(w.budget_bytes)}  "
            f"{rate} rows/s  {w.in_flight} in flight{pools}  up {human_duration(w.uptime_seconds)}{cache}",
            worker=w.worker, backend=w.backend, discipline=w.discipline)

    def _render_worker(self, now: float) -> None:
        if not self.gateway:
            assert self.worker is not None
            self._set_header(Content.assemble(Content.from_markup("[green]connected[/green] "),
                                              self._worker_text(self.worker, now), f"  {self.address}"))
            return
        total = math.fsum(w.rows_per_second or 0.0 for w in self.worker_views.values())
        lines = [Content.from_markup(f"[green]connected[/green] gateway $address: {len(self.worker_views)} "
                                     f"worker(s)  {total:.1f} rows/s", address=str(self.address))]
        lines += [self._worker_text(self.worker_views[name], now) for name in sorted(self.worker_views)]
        self._set_header(Content("\n").join(lines))

    def _key(self, row: ModelRow) -> str:
        return f"{row.worker}/{row.name}" if self.gateway else row.name

    def _render_table(self) -> None:
        table = self._table
        chosen = self._chosen_name()
        if self._worker_column != (self.gateway and len(self.worker_views) > 1):
            self._worker_column = not self._worker_column
            table.clear(columns=True)
            self._add_columns()
        if not self._worker_column and self.sort_key == WORKER_COLUMN[0]:
            self.sort_key = "name"
        rows = visible(self.rows, self.name_filter, self.sort_key, self.descending)
        table.clear()
        keys: dict[str, None] = {}      # the rows' keys, in order
        for row in rows:
            key = self._key(row)
            if key in keys:     # a peer that names a model twice: its first row only (a key is one row)
                continue
            keys[key] = None
            texts = ((row.worker,) if self._worker_column else ()) + cells(row)
            # a str cell is read as Rich markup: peer names go in as Text, shown as they are
            table.add_row(*(Text(text) for text in texts), key=key)
        if chosen in keys:
            table.move_cursor(row=list(keys).index(chosen), animate=False)
        for key, heading in self._columns():
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
        key = self._chosen_name()
        return next((r for r in self.rows if self._key(r) == key), None)

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
        if row.p50_seconds is not None and row.p99_seconds is not None:
            latency += f", p50 {human_seconds(row.p50_seconds)}, p99 {human_seconds(row.p99_seconds)}"
        mix = ", ".join(f"{n}x{size}" for size, n in row.batch_mix) or "none"
        hold = (f"{human_seconds(row.batch_delay_seconds)} for "
                f"{row.batch_target_rows or 'the default'} rows" if row.batch_delay_seconds else "off")
        rejected = ", ".join(f"{n} {reason}" for reason, n in row.rejections) or "none"
        hooks = ", ".join(f"{n} {hook}" for hook, n in row.hook_failures)
        thrash = "  [b red]thrashing[/b red]: loaded and evicted within the last update" if row.thrashing else ""
        on = f" on {row.worker}" if self.gateway else ""
        per_request = ("" if row.misses_per_request is None
                       else f" ({row.misses_per_request:.2f} per request last update)")
        policy = f" ({row.eviction_policy})" if row.eviction_policy else ""
        evict = ("not evictable now" if row.eviction_rank is None
                 else f"eviction rank {row.eviction_rank}{policy}" + (": next to go" if row.eviction_rank == 1 else ""))
        history = spark(self._model_rates.get(self._key(row), ()))
        # names, states, reasons and map keys come from the network: template variables, shown
        # as they are; only this method's own tags are markup
        detail.update(Content.from_markup(
            f"[b]$name[/b]$on $state v{row.version}"
            + (f"  rows/s {history}" if history else "") + "\n"
            + ("reason: $reason\n" if row.reason else "")
            + f"residency $residency: {human_bytes(row.resident_bytes)} of "
              f"{human_bytes(row.weight_bytes)} on the device; loads/evictions {loads_text(row)}{thrash}\n"
              f"weight misses {row.weight_misses}{per_request}; $evict\n"
              f"queue {row.queue_depth}, in flight {row.in_flight}; weight {row.weight:g} "
              f"(device share/due {share_text(row)}); max_batch_size {row.max_batch_size or 'uncapped'}\n"
              f"batch hold: {hold}\n"
              f"learned cost by batch size: {costs}\n"
              f"last update: {latency}; batch sizes run: {mix}\n"
              f"since start: {row.requests} rows in {row.executions} executions; "
              f"{row.successes} answered, {row.failures} failed; rejected: $rejected"
            + ("; [b red]hook failures[/b red]: $hooks" if hooks else ""),
            name=row.name, on=on, state=row.state, reason=row.reason, residency=row.residency, evict=evict,
            rejected=rejected, hooks=hooks))

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
        line = f"{self._stamp()} {text}"
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
        keys = [key for key, _ in self._columns()]
        self.sort_key = keys[(keys.index(self.sort_key) + 1) % len(keys)] if self.sort_key in keys else keys[0]
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
            if method in connection.KSERVE_METHODS:
                response = await connection.kserve_call(self.address, method, request)
            else:
                response = await connection.call(self.address, method, request)
        except GRPCError as exc:
            answer = f"{method} refused: {exc.status.name}: {exc.message or ''}"
        except connection.CONNECTION_ERRORS as exc:
            answer = f"{method} failed: {exc or type(exc).__name__}"
        else:
            answer = f"{method}: {done}"
            if isinstance(response, pb.CompactMemoryResponse):
                answer += f": {response.message} ({human_bytes(response.freed_bytes)} freed)"
        # a refusal's message and CompactMemory's answer come from the peer, like its statuses
        answer = self.last_answer = show_controls(answer)
        self._log_event(answer)
        failed = not answer.startswith(f"{method}: ")
        self.notify(answer, markup=False, severity="error" if failed else "information")
        await self._notify_change()

    def _model_or_say(self) -> ModelRow | None:
        row = self.chosen()
        if row is None:
            self.notify("no model chosen", severity="warning")
        return row

    def _on(self, row: ModelRow) -> str:
        """`` on worker1`` through a gateway (where the action goes), else nothing."""
        return f" on {row.worker}" if self.gateway else ""

    def _worker_of(self, row: ModelRow) -> str:
        """The request's ``worker`` field: the row's worker through a gateway, else empty."""
        return row.worker if self.gateway else ""

    def action_pin(self) -> None:
        if row := self._model_or_say():
            self._ask(f"Pin {row.name}{self._on(row)} on the device (residency device)?", "SetModelResidency",
                      pb.SetModelResidencyRequest(model=row.name, residency="device", worker=self._worker_of(row)),
                      f"{row.name}{self._on(row)} pinned (device)")

    def action_unpin(self) -> None:
        if row := self._model_or_say():
            self._ask(f"Unpin {row.name}{self._on(row)} (residency system: on the device on demand)?",
                      "SetModelResidency",
                      pb.SetModelResidencyRequest(model=row.name, residency="system", worker=self._worker_of(row)),
                      f"{row.name}{self._on(row)} unpinned (system)")

    def _policy(self, row: ModelRow, field: str, question: str, current: str,
                parse: Callable[[str], float]) -> None:
        def entered(value: float | None) -> None:
            if value is not None:
                self._ask(f"Set {row.name}'s {field}{self._on(row)} to {value:g}?", "SetModelPolicy",
                          pb.SetModelPolicyRequest(model=row.name, worker=self._worker_of(row), **{field: value}),
                          f"{row.name}{self._on(row)} {field} = {value:g}")
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

    def action_load(self) -> None:
        chosen = self.chosen()
        where = "every worker" if self.gateway else "the worker"

        def entered(name: object) -> None:
            if name is not None:
                self._ask(f"Load {name} on {where} (RepositoryModelLoad; a loaded model is reloaded)?",
                          "RepositoryModelLoad", kpb.RepositoryModelLoadRequest(model_name=str(name)),
                          f"{name} loaded")
        self.push_screen(ValueScreen("model to load (model_control_mode explicit)",
                                     chosen.name if chosen else "", _model_name), entered)

    def action_unload(self) -> None:
        if row := self._model_or_say():
            where = " on every worker" if self.gateway else ""
            self._ask(f"Unload {row.name}{where} (RepositoryModelUnload)?", "RepositoryModelUnload",
                      kpb.RepositoryModelUnloadRequest(model_name=row.name), f"{row.name} unloaded")

    def action_compact(self) -> None:
        row = self.chosen() if self.gateway else None
        where = f"{row.worker}'s" if row is not None else "the worker's"
        self._ask(f"Compact {where} device memory (CompactMemory)?", "CompactMemory",
                  pb.CompactMemoryRequest(worker=row.worker if row is not None else ""), "done")


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

"""What the chat-bot webhook adds to an agent turn, how a conversation's turns cost as it grows, and how fast WeCom
hears back.

    python bench/bot.py [--messages 300] [--turns 200]

One real gateway app on a loopback port, thinking with a zero-latency scripted model (so only the gateway is
measured), the store a real SQLite file:

1. ``webhook``: the same one-step agent turn as a signed ``POST /bot/v1/messages`` (signature, nonce claimed in the
   store, the message stored, the turn joined to its conversation's run, the reply stored and marked delivered)
   and as ``POST /v1/chat/completions`` with ``model = "agent:helper"``, sequentially, each message a new
   conversation; p50 of each and the ratio.
2. ``conversation``: ``--turns`` messages in one conversation (one growing trajectory, no summaries): p50 of the
   first tenth of the turns and of the last tenth, and their ratio (what loading and saving a longer run costs).
3. ``wecom``: a WeCom message while the model takes 2 s: time until WeCom gets its answer (the adapter stores
   the message and acknowledges; the reply goes later through the send API), against the model's 2 s.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.sections import parser as sections_parser  # noqa: E402
from bench.sections import run  # noqa: E402
from tests.gateway.bot.support import bot_gateway  # noqa: E402
from tests.gateway.bot.wecom_side import SendAPI, post_as_wecom, wecom_config, wecom_message  # noqa: E402
from tests.standin import ServerThread  # noqa: E402

console = Console()


def _p50_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


def webhook(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, \
            bot_gateway(Path(tmp), ["Done."] * (3 * args.messages + 50), rate=0) as gw, \
            httpx.Client(base_url=gw.url, timeout=30) as client:
        def bot(i: int) -> float:
            started = time.perf_counter()
            r = gw.post("/bot/v1/messages", {"conversation_id": f"c{i}", "user_id": "u", "text": "hello"},
                        client=client)
            assert r.status_code == 200 and r.json()["reply"] == "Done.", r.text
            return time.perf_counter() - started

        def chat(i: int) -> float:
            started = time.perf_counter()
            r = client.post("/v1/chat/completions", json={"model": "agent:helper",
                                                          "messages": [{"role": "user", "content": "hello"}]})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Done.", r.text
            return time.perf_counter() - started

        for i in range(20):  # warm-up
            bot(-i - 1)
            chat(i)
        hooks = [bot(i) for i in range(args.messages)]
        chats = [chat(i) for i in range(args.messages)]
    table = Table("one-step agent turn", "p50 ms", "ratio")
    table.add_row("POST /v1/chat/completions agent:helper", f"{_p50_ms(chats):.2f}", "1.00")
    table.add_row("signed POST /bot/v1/messages", f"{_p50_ms(hooks):.2f}", f"{_p50_ms(hooks) / _p50_ms(chats):.2f}")
    console.print(table)


def conversation(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, \
            bot_gateway(Path(tmp), ["Noted."] * (args.turns + 10), rate=0,
                        env={"HARNESS_PROFILES__0__CONTEXT_BUDGET_TOKENS": "0"}) as gw, \
            httpx.Client(timeout=30) as client:
        samples = []
        for turn in range(args.turns):
            started = time.perf_counter()
            r = gw.post("/bot/v1/messages", {"conversation_id": "one", "user_id": "u", "text": f"turn {turn}"},
                        client=client)
            samples.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
    tenth = max(1, args.turns // 10)
    first, last = _p50_ms(samples[:tenth]), _p50_ms(samples[-tenth:])
    table = Table(f"one conversation, {args.turns} turns", "p50 ms", "ratio")
    table.add_row(f"turns 1-{tenth}", f"{first:.2f}", "1.00")
    table.add_row(f"turns {args.turns - tenth + 1}-{args.turns}", f"{last:.2f}", f"{last / first:.2f}")
    console.print(table)


def wecom(args: argparse.Namespace) -> None:
    api = SendAPI()
    acks = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        api_server = stack.enter_context(ServerThread(api.app))
        gw = stack.enter_context(bot_gateway(Path(tmp), ["Reply."] * 20, delay=2.0, rate=0,
                                             **wecom_config(api_server.url)))
        client = stack.enter_context(httpx.Client(timeout=30))
        for i in range(5):
            started = time.perf_counter()
            message = wecom_message(f"message {i}", str(1000 + i), user=f"user{i}")
            assert post_as_wecom(gw.url, message, client=client).status_code == 200
            acks.append(time.perf_counter() - started)
        api.wait(5)
    table = Table("WeCom message, model takes 2 s", "ms")
    table.add_row("acknowledged after (p50 of 5)", f"{_p50_ms(acks):.1f}")
    table.add_row("model time", "2000")
    console.print(table)


SECTIONS = {"webhook": webhook, "conversation": conversation, "wecom": wecom}

if __name__ == "__main__":
    p = sections_parser(__doc__, SECTIONS)
    p.add_argument("--messages", type=int, default=300)
    p.add_argument("--turns", type=int, default=200)
    run(p.parse_args(), SECTIONS)

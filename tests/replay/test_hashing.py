from replay import hashing


def test_canonical_form_ignores_cosmetic_differences() -> None:
    sent = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1,"b":2}'}}]}
    echoed = {"role": "assistant", "content": "", "refusal": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 2, "a": 1}'}}]}
    assert hashing.stitch_hash(sent) == hashing.stitch_hash(echoed)
    parts = {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}
    assert hashing.stitch_hash(parts) == hashing.stitch_hash({"role": "user", "content": "hi there"})


def test_different_content_differs() -> None:
    a, b = {"role": "user", "content": "a"}, {"role": "user", "content": "b"}
    assert hashing.stitch_hash(a) != hashing.stitch_hash(b)
    assert hashing.stitch_hash({"role": "user", "content": "a"}) != hashing.stitch_hash(
        {"role": "assistant", "content": "a"})


def test_prefix_hashes_chain() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    full = hashing.prefix_hashes(msgs)
    assert full[:2] == hashing.prefix_hashes(msgs[:2])
    assert hashing.chain(full[1], hashing.stitch_hash(msgs[2])) == full[2]
    assert len(set(full)) == 3
    assert hashing.anchor_index(msgs) == 1

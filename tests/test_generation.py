"""The sampler and the top-k / top-p filter against hand values; ``generate``'s fast paths (shared
prompt prefix, compaction of finished rows, reserved KV cache) against the plain sampling loop on the
tiny fp32 model, and its work counters."""
import math

import pytest
import torch
import torch.nn.functional as F

from marft.engines.flops import model_shape
from marft.engines.generation import (_CACHE, Sampling, _common_prefix, _filter, positions_of, _ReservedLayer, _sample,
                              _stop_string_hit, encode_chats, generate, sequence_logprobs)
from marft.engines.models import load_base


def test_sampler_follows_the_distribution_and_never_picks_masked_tokens():
    probs = torch.tensor([0.1, 0.2, 0.0, 0.7])
    logits = probs.log().expand(20000, 4).clone()  # log 0 = -inf
    draws = _sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    assert freq[2] == 0
    # binomial standard error at n=20000 is <= 0.0035; allow 4 of them
    assert torch.allclose(freq, probs, atol=0.014), freq


def test_sampler_is_reproducible_with_a_seeded_generator():
    logits = torch.randn(8, 50)
    a = _sample(logits, torch.Generator().manual_seed(3))
    b = _sample(logits, torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_top_k_and_top_p_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    k2 = _filter(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(k2[0, :2]).all() and torch.isinf(k2[0, 2:]).all()
    # softmax([2,1,0,-1]) = .644, .237, .087, .032: the nucleus reaching 0.8 is the first two tokens,
    # reaching 0.9 the first three
    p = logits.softmax(-1)[0]
    assert math.isclose(float(p[0] + p[1]), 0.881, abs_tol=1e-3)
    assert torch.isfinite(_filter(logits, 0, 0.8)[0]).tolist() == [True, True, False, False]
    assert torch.isfinite(_filter(logits, 0, 0.9)[0]).tolist() == [True, True, True, False]
    assert torch.isfinite(_filter(logits, 0, 0.5)[0]).tolist() == [True, False, False, False]


# --- generate: prefix sharing, compaction and the reserved cache against the plain loop --------

SYSTEM = "You are the planner of a team that solves problems together."
# prompts of different lengths after a common prefix of about 40 tokens (system turn + "Calculate")
CHATS = [[{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Calculate " + " + ".join(str(j) for j in range(i + 1)) + "."}]
         for i in range(6)]
# generate's switches: all on (the defaults), all off, then each on alone
FAST_PATHS = [{}, {"compact": False, "share_prefix": False, "preallocate": False},
              {"share_prefix": False, "preallocate": False}, {"compact": False, "preallocate": False},
              {"compact": False, "share_prefix": False},
              # the static decode loop (a GPU's default; no CUDA graph on a CPU), with and without the shared prefix
              {"static": True}, {"static": True, "share_prefix": False}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model, tok = load_base(str(tiny_model_dir), "float32", "cpu")
    # a frequent set of stop tokens, so that replies end at many different steps
    return model, tok, list(range(0, len(tok), 5))


@torch.no_grad()
def plain_generate(model, tok, chats, sampling, stop_ids, generator):
    """The sampling loop before prefix sharing, compaction and preallocation: the reference."""
    ids, pmask = encode_chats(tok, chats, "cpu")
    B, temp = len(chats), sampling.temperature if sampling.temperature > 0 else 1.0
    mask = pmask.long()
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask), use_cache=True, logits_to_keep=1)
    past, logits = getattr(out, _CACHE), out.logits[:, -1]
    tokens, logps, valid = [], [], []
    done = torch.zeros(B, dtype=torch.bool)
    texts = [[] for _ in range(B)]
    for _ in range(sampling.max_new_tokens):
        logp = F.log_softmax(logits.float() / temp, dim=-1)
        if sampling.temperature > 0:
            nxt = _sample(_filter(logp, sampling.top_k, sampling.top_p), generator)
        else:
            nxt = logp.argmax(-1)
        live = ~done
        nxt = torch.where(live, nxt, torch.full_like(nxt, tok.pad_token_id))
        tokens.append(nxt)
        valid.append(live)
        logps.append(logp.gather(-1, nxt[:, None]).squeeze(-1) * live)
        hit = live & torch.isin(nxt, torch.tensor(stop_ids))
        if sampling.stop:
            hit |= _stop_string_hit(tok, nxt, done, texts, sampling.stop)
        done = done | hit
        if bool(done.all()):
            break
        mask = torch.cat([mask, live.long()[:, None]], 1)
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions_of(mask)[:, -1:],
                    use_cache=True, **{_CACHE: past})
        past, logits = getattr(out, _CACHE), out.logits[:, -1]
    return ids, pmask, torch.stack(tokens, 1), torch.stack(valid, 1), torch.stack(logps, 1)


SAMPLINGS = [Sampling(temperature=1.0, max_new_tokens=14),
             Sampling(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=14),
             Sampling(temperature=0.0, max_new_tokens=14),
             Sampling(temperature=1.0, max_new_tokens=14, stop=("e",))]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["T1", "T0.7-top", "greedy", "stop-string"])
def test_every_path_gives_the_replies_of_the_plain_loop(tiny, sampling):
    model, tok, stops = tiny
    want = plain_generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0))
    ids, pmask, want_ids, want_mask, want_lp = want
    lengths = want_mask.sum(1)
    assert len(set(lengths.tolist())) >= 3, lengths  # replies end at different steps: rows leave the batch
    for flags in FAST_PATHS:
        got = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), **flags)
        assert torch.equal(got.prompt_ids, ids) and torch.equal(got.prompt_mask, pmask), flags  # layout kept
        assert torch.equal(got.response_ids, want_ids) and torch.equal(got.response_mask, want_mask), flags
        assert torch.allclose(got.logprobs, want_lp, atol=1e-5, rtol=0), (flags, (got.logprobs - want_lp).abs().max())
        assert got.texts == tok.batch_decode(want_ids, skip_special_tokens=True)
        if not sampling.stop:  # a reply ends with a stop token, or is cut at max_new_tokens
            last = want_ids.gather(1, (lengths - 1)[:, None])[:, 0]
            assert torch.equal(got.truncated, ~torch.isin(last, torch.tensor(stops))), flags


def test_the_fast_path_computes_less_and_counts_the_needed_work(tiny):
    model, tok, stops = tiny
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    plain = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0),
                     compact=False, share_prefix=False, preallocate=False)
    fast = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0))
    B, P = plain.prompt_ids.shape
    R = plain.response_ids.shape[1]
    shared = _common_prefix(plain.prompt_ids, plain.prompt_mask.sum(1))
    assert shared >= 30  # the system turn and "Calculate"
    # what was computed: the plain loop runs every padded position and every row at every step
    assert plain.spent.prefill_tokens == B * P and plain.spent.decode_tokens == B * (R - 1)
    assert fast.spent.prefill_tokens == shared + B * (P - shared)
    assert fast.spent.decode_tokens < plain.spent.decode_tokens  # finished rows left the batch
    assert fast.spent.decode_context < plain.spent.decode_context
    # what is needed does not depend on the path: prompts with the prefix once, each reply's tokens
    # but its last fed back, logits for every generated token
    assert plain.work == fast.work
    n, L = fast.response_mask.sum(1), fast.prompt_mask.sum(1)
    assert fast.work.prefill_tokens == int(L.sum()) - (B - 1) * shared
    assert fast.work.decode_tokens == int(n.sum()) - B and fast.work.logits == int(n.sum())
    assert fast.work.decode_context == sum(int(L[b]) + i + 1 for b in range(B) for i in range(int(n[b]) - 1))
    assert fast.work.prefill_context == (sum(range(1, shared + 1))
                                         + sum(shared + j + 1 for b in range(B) for j in range(int(L[b]) - shared)))
    for w in (fast.work, fast.spent, plain.spent):
        assert w.prefill_tokens <= plain.spent.prefill_tokens and w.decode_tokens <= plain.spent.decode_tokens
    shape = model_shape(model)
    w = fast.work
    assert w.flops(shape) == shape.forward(w.prefill_tokens + w.decode_tokens, w.prefill_context + w.decode_context, w.logits)
    assert fast.work.flops(shape) < fast.spent.flops(shape) < plain.spent.flops(shape)
    assert (fast.work + plain.work).logits == 2 * fast.work.logits


def test_recorded_logprobs_equal_the_teacher_forced_ones(tiny):
    model, tok, stops = tiny
    sampling = Sampling(temperature=0.7, max_new_tokens=14)
    out = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(1))
    lp = sequence_logprobs(model, out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, 0.7)
    assert torch.allclose(lp, out.logprobs, atol=1e-5), (lp - out.logprobs).abs().max()


def test_a_single_prompt_and_identical_prompts(tiny):
    model, tok, stops = tiny
    sampling = Sampling(temperature=1.0, max_new_tokens=10)
    one = generate(model, tok, CHATS[:1], sampling, stops, torch.Generator().manual_seed(2))
    assert one.spent.prefill_tokens == one.prompt_ids.shape[1]  # nothing to share in one row
    same = generate(model, tok, [CHATS[0]] * 4, sampling, stops, torch.Generator().manual_seed(2))
    L = int(same.prompt_mask[0].sum())
    assert same.spent.prefill_tokens == (L - 1) + 4  # all but the last token shared
    want = plain_generate(model, tok, [CHATS[0]] * 4, sampling, stops, torch.Generator().manual_seed(2))
    assert torch.equal(same.response_ids, want[2]) and torch.allclose(same.logprobs, want[4], atol=1e-5)


def test_common_prefix_of_left_padded_prompts():
    pad = 0
    ids = torch.tensor([[pad, pad, 5, 6, 7, 8], [5, 6, 7, 9, 1, 2], [pad, 5, 6, 7, 8, 3]])
    assert _common_prefix(ids, (ids != pad).sum(1)) == 3
    same = torch.tensor([[pad, 5, 6, 7], [pad, 5, 6, 7]])
    assert _common_prefix(same, (same != pad).sum(1)) == 2  # every row keeps its last token
    assert _common_prefix(ids[:1], torch.tensor([4])) == 0
    other = torch.tensor([[1, 2, 3], [4, 2, 3]])
    assert _common_prefix(other, torch.tensor([3, 3])) == 0


def test_reserved_cache_layer_matches_concatenation():
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 2, 5, 4, generator=g), torch.randn(3, 2, 5, 4, generator=g)
    layer = _ReservedLayer(k, v, room=2)
    steps = [(torch.randn(3, 2, 1, 4, generator=g), torch.randn(3, 2, 1, 4, generator=g)) for _ in range(3)]
    want_k, want_v = k, v
    for i, (nk, nv) in enumerate(steps):  # the third step is past the room: concatenation
        got_k, got_v = layer.update(nk, nv)
        want_k, want_v = torch.cat([want_k, nk], -2), torch.cat([want_v, nv], -2)
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v) and layer.get_seq_length() == 6 + i
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert torch.equal(layer.keys, want_k[[2, 0]]) and torch.equal(layer.values, want_v[[2, 0]])


def test_sampler_uses_the_given_uniform_numbers():
    logits = torch.randn(8, 50)
    u = torch.rand(8, 1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(_sample(logits, None, u), _sample(logits, torch.Generator().manual_seed(3)))


def test_replies_cut_at_max_new_tokens_do_not_feed_their_last_token(tiny):
    model, tok, _ = tiny
    for flags in FAST_PATHS:
        out = generate(model, tok, CHATS, Sampling(temperature=1.0, max_new_tokens=3), [],
                       torch.Generator().manual_seed(0), **flags)
        assert out.truncated.all() and out.response_mask.all()
        assert out.spent.decode_tokens == len(CHATS) * 2 == out.work.decode_tokens, flags


@pytest.mark.parametrize("flags", FAST_PATHS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "defaults")
def test_every_path_leaves_the_generator_as_the_plain_loop_does(tiny, flags):
    """The static loop draws every step's numbers at once and gives back those of steps after the
    replies ended: the next call sees the same stream whatever path ran."""
    model, tok, stops = tiny
    sampling = Sampling(temperature=1.0, max_new_tokens=14)
    want = torch.Generator().manual_seed(5)
    plain_generate(model, tok, CHATS, sampling, stops, want)
    got = torch.Generator().manual_seed(5)
    generate(model, tok, CHATS, sampling, stops, got, **flags)
    assert torch.equal(got.get_state(), want.get_state())


def test_static_loop_with_eager_attention_gives_the_plain_replies(tiny):
    """Eager attention adds the static loop's mask to the scores (an additive float mask, not sdpa's
    boolean one)."""
    model, tok, stops = tiny
    sampling = SAMPLINGS[0]
    want = plain_generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0))
    before = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        got = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), static=True)
    finally:
        model.set_attn_implementation(before)
    assert torch.equal(got.response_ids, want[2]) and torch.allclose(got.logprobs, want[4], atol=1e-5, rtol=0)


def test_static_loop_reads_every_step_from_the_device(tiny):
    """What a CUDA graph needs: every decode step feeds the model tensors of the same shapes (the
    whole cache buffer, the whole mask), and the cache column written comes from a device tensor."""
    import marft.engines.generation as gen

    model, tok, stops = tiny
    shapes = []
    real = gen._StaticDecoder._forward

    def spy(self):
        shapes.append((tuple(self.ids.shape), tuple(self.mask.shape), tuple(self.past.layers[0].keys.shape),
                       int(self.at), int((self.mask[0, 0, 0] == self.on).sum())))
        return real(self)

    gen._StaticDecoder._forward = spy
    try:
        out = generate(model, tok, CHATS, Sampling(temperature=1.0, max_new_tokens=6), [], torch.Generator().manual_seed(0),
                       static=True, share_prefix=False)
    finally:
        gen._StaticDecoder._forward = real
    P = out.prompt_ids.shape[1]
    assert len(shapes) == 5 and len({s[:3] for s in shapes}) == 1  # 6 tokens, the last not fed back
    assert [s[3] for s in shapes] == [P + i for i in range(5)]  # the column written at each step
    first_row = int(out.prompt_mask[0].sum())
    assert [s[4] for s in shapes] == [first_row + i + 1 for i in range(5)]  # the mask grows by one column a step


def test_no_module_draws_random_numbers_on_a_fixed_device():
    """The first GPU run crashed on ``torch.rand(..., generator=cpu_generator, device=logits.device)``.
    A draw that passes a generator must take the generator's own device (``marft.engines.generation._uniform``
    does, and moves the numbers); any other draw with both a generator and a device is a bug."""
    import ast
    from pathlib import Path

    allowed = {("generation.py", "_uniform"), ("flops.py", "matmul_rate")}  # device taken from the generator / made on it
    found = []
    for path in sorted(Path("marft").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for call in [n for n in ast.walk(fn) if isinstance(n, ast.Call)]:
                kws = {k.arg for k in call.keywords}
                if "generator" in kws and "device" in kws and (path.name, fn.name) not in allowed:
                    found.append(f"{path}:{call.lineno} in {fn.name}")
    assert not found, found


def test_a_cpu_generator_drives_a_model_elsewhere():
    """The numbers come from the generator's device and are moved to the model's ("meta" stands in
    for a GPU here): the same numbers as drawn step by step on the CPU."""
    from marft.engines.generation import _Uniforms

    g = torch.Generator().manual_seed(1)
    u = _Uniforms(g, 3, 4, torch.device("meta"))
    assert u.u.device.type == "meta" and u.step(0, torch.arange(4)).shape == (4, 1)
    cpu = _Uniforms(torch.Generator().manual_seed(1), 3, 4, torch.device("cpu"))
    ref = torch.Generator().manual_seed(1)
    assert torch.equal(cpu.u, torch.cat([torch.rand(1, 4, generator=ref) for _ in range(3)]))


def test_the_compiled_decode_step_gives_the_plain_replies_and_compiles_once(tiny):
    """``compile`` (rollout.compile): the static loop's step under torch.compile gives the plain loop's
    tokens (fp32), and a batch and a cache length of another size run the compiled step again
    without compiling anew (dynamic shapes), so a rollout's varying prompts compile once."""
    import torch._dynamo

    from marft.engines.generation import _compiled_step

    model, tok, stops = tiny
    sampling = SAMPLINGS[0]
    want = plain_generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    got = generate(model, tok, CHATS, sampling, stops, torch.Generator().manual_seed(0), compile=True)
    assert torch.equal(got.response_ids, want[2]) and torch.allclose(got.logprobs, want[4], atol=1e-5, rtol=0)
    frames = counters["stats"]["unique_graphs"]
    assert frames >= 1 and not counters["graph_break"], dict(counters["graph_break"])
    # fewer, shorter prompts and longer replies: other shapes, the same compiled step
    other = generate(model, tok, CHATS[:3], Sampling(temperature=1.0, max_new_tokens=20), stops,
                     torch.Generator().manual_seed(1), compile=True)
    assert counters["stats"]["unique_graphs"] == frames
    plain = plain_generate(model, tok, CHATS[:3], Sampling(temperature=1.0, max_new_tokens=20), stops,
                           torch.Generator().manual_seed(1))
    assert torch.equal(other.response_ids, plain[2])
    assert _compiled_step() is _compiled_step()  # one compiled function per process

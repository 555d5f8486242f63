"""A user's own base model, where it differs from the tiny Llama of the other tests: variables for
its chat template (Qwen3's enable_thinking), code of its own (trust_remote_code), a multimodal
config whose sizes are in text_config, and Gemma 2's soft-capped attention and logits, which the
learner must compute as the model's forward does."""
import json
from types import SimpleNamespace

import pytest
import torch

from marft.errors import UserError
from marft.engines import packing
from marft.engines.generation import positions_of, render_chat
from marft.engines.models import TeamModel, build_tiny_model, hidden_size, load_base
from marft.run.config import load_config
from marft.team import build_team

THINKING = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% if enable_thinking is defined and not enable_thinking %}"
            "<think></think>{% endif %}{% endif %}")


def test_chat_template_variables_reach_every_prompt(tiny_model_dir):
    """model.chat_template_kwargs: {enable_thinking: false} renders Qwen3's empty thinking block, and
    only then."""
    cfg = load_config("configs/duo_arithmetic.yaml", [f"model.name={tiny_model_dir}", "model.device=cpu",
                                                      "model.chat_template_kwargs={enable_thinking: false}"])
    models = TeamModel(build_team(cfg.team), cfg.model)
    tok = next(iter(models.tokenizers.values()))
    tok.chat_template = THINKING
    chat = [{"role": "system", "content": "add"}, {"role": "user", "content": "2 + 3"}]
    assert render_chat(tok, chat) == "<system>add\n<user>2 + 3\n<assistant><think></think>"
    _, plain = load_base(str(tiny_model_dir), "float32", "cpu")
    plain.chat_template = THINKING
    assert render_chat(plain, chat) == "<system>add\n<user>2 + 3\n<assistant>"


def test_a_model_with_code_of_its_own_is_one_line_until_trusted(tmp_path):
    d = build_tiny_model(tmp_path / "custom")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="custom_x", auto_map={"AutoConfig": "custom.MyConfig", "AutoModelForCausalLM": "custom.MyModel"})
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "custom.py").write_text("raise RuntimeError('the repository code ran')\n")
    with pytest.raises(UserError, match="runs code from its own repository; if you trust it, set model.trust_remote_code: true"):
        load_base(str(d), "float32", "cpu")
    with pytest.raises(RuntimeError, match="the repository code ran"):  # trusted: its code runs
        load_base(str(d), "float32", "cpu", trust_remote_code=True)


def test_a_multimodal_config_gives_its_text_width():
    vision_language = SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(hidden_size=2560)))
    assert hidden_size(vision_language) == 2560
    assert hidden_size(SimpleNamespace(config=SimpleNamespace(hidden_size=576))) == 576


def test_soft_capped_attention_and_logits_are_the_models_own():
    """Gemma 2 caps its attention scores and its logits (cap * tanh(x / cap)). The learner's pass
    (marft's CPU attention, the head applied to chosen positions) gives the log-probabilities and
    entropies of the model's forward; small caps so that leaving either out would show."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                       sliding_window=64, max_position_embeddings=128, attn_implementation="eager")
    model = Gemma2ForCausalLM(cfg).eval()
    for p in model.parameters():  # scores and logits well past the caps
        p.data.mul_(4.0)
    g = torch.Generator().manual_seed(1)
    prompts, replies = [9, 11], [5, 3]
    rows = [packing.Row(torch.randint(1, 64, (n + r,), generator=g), n, r) for n, r in zip(prompts, replies)]
    with torch.no_grad():
        lp, ent, _ = packing.response_logprobs(model, rows, 1.0, True, share_prefix=False)
        for b, row in enumerate(rows):
            ids = row.ids[None]
            mask = torch.ones_like(ids)
            z = model(input_ids=ids, attention_mask=mask, position_ids=positions_of(mask)).logits[0].float()
            logp = z[row.n_prompt - 1:-1].log_softmax(-1)
            want = logp.gather(-1, row.ids[row.n_prompt:, None]).squeeze(-1)
            assert torch.allclose(lp[b, :row.n_resp], want, atol=1e-5), (lp[b, :row.n_resp] - want).abs().max()
            want_ent = -(logp.exp() * logp).sum(-1)
            assert torch.allclose(ent[b, :row.n_resp], want_ent, atol=1e-5)


def test_the_critic_reads_a_transcript_after_the_tokenizers_opening(tiny_model_dir):
    """Llama 3 and Gemma saw every input after their BOS token: the critic's transcript (not a
    chat template's rendering) gets it too, once, and keeps it when a long one is cut to its end;
    tokenizers that add none (SmolLM2, Qwen, the tiny model) encode the transcript as before."""
    from tokenizers.processors import TemplateProcessing
    from marft.maths.critic import encode_state, opening

    _, tok = load_base(str(tiny_model_dir), "float32", "cpu")
    texts = ["3", "speaker: 4\nsolver: the total is 7 because 3 + 4 = 7"]
    plain = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=8, add_special_tokens=False)
    got = encode_state(tok, texts, 8)
    assert opening(tok) == ""
    assert torch.equal(got["input_ids"], plain["input_ids"]) and torch.equal(got["attention_mask"], plain["attention_mask"])

    _, tok = load_base(str(tiny_model_dir), "float32", "cpu")  # now a tokenizer that opens with BOS
    tok.bos_token = "<|im_start|>"
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A", special_tokens=[(tok.bos_token, bos)])
    assert opening(tok) == "<|im_start|>"
    got = encode_state(tok, [texts[0], "<|im_start|>" + texts[1]], 8)
    for row, mask, text in zip(got["input_ids"], got["attention_mask"], texts):
        ids = row[mask.bool()].tolist()
        assert ids[0] == bos and bos not in ids[1:] and len(ids) <= 8  # once, first, within the limit
        assert ids[1:] == tok(text, add_special_tokens=False)["input_ids"][-(len(ids) - 1):]  # the text's end
    assert got["attention_mask"][0].tolist()[0] == 0  # left padding


def test_the_templates_turn_end_stops_a_reply(tiny_model_dir):
    """A model whose eos is one token and whose chat template closes a turn with another (a base
    model given ChatML): both end a reply, so replies do not all run to max_new_tokens."""
    from marft.engines.models import stop_token_ids

    model, tok = load_base(str(tiny_model_dir), "float32", "cpu")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(model, tok) == [end]  # the tiny model's eos is its template's turn end
    tok.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tok.eos_token_id
    assert tok.eos_token_id != end
    assert stop_token_ids(model, tok) == sorted({tok.eos_token_id, end})
    model, tok = load_base(str(tiny_model_dir), "float32", "cpu")
    tok.eos_token = "<|endoftext|>"
    model.generation_config.eos_token_id = tok.eos_token_id
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # no turn end shown
    assert stop_token_ids(model, tok) == [tok.eos_token_id]


def test_template_variables_that_marft_sets_itself_are_refused():
    with pytest.raises(UserError, match=r"model.chat_template_kwargs may not set add_generation_prompt, tools: marft sets"):
        load_config("configs/duo_arithmetic.yaml", ["model.chat_template_kwargs={tools: [], add_generation_prompt: false}"])

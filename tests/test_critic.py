"""Critic features line up with the positions they value."""
import torch

from marft.run.config import load_config
from marft.maths.critic import ValueHead, state_features, token_features
from marft.engines.models import TeamModel
from marft.team import build_team


def test_token_features_are_the_hidden_state_before_each_reply_token(tiny_model_dir):
    cfg = load_config(None, [f"model.name={tiny_model_dir}", "model.dtype=float32", "model.device=cpu"])
    team = build_team(cfg.team)
    models = TeamModel(team, cfg.model)
    tok = next(iter(models.tokenizers.values()))
    texts = ["Problem: 1 + 2", "Problem: a longer state text for the second row"]
    reply = torch.tensor([[5, 6, 7, 0], [8, 9, 10, 11]])
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    feats = token_features(models, "solver", texts, reply, mask)
    assert feats.shape == (2, 4, 64)
    # position j of row 1 = last hidden state after the state tokens and reply tokens < j
    state_ids = tok(texts[1], add_special_tokens=False, return_tensors="pt")["input_ids"]
    with models.reference("solver") as (model, _), torch.no_grad():
        for j in range(4):
            ids = torch.cat([state_ids, reply[1:, :j]], 1)
            h = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0, -1]
            assert torch.allclose(feats[1, j], h, atol=1e-4), j
    # the action-level feature of a state is the token-level feature of its reply's first token
    assert torch.allclose(state_features(models, "solver", texts)[1], feats[1, 0], atol=1e-4)


def test_value_head_shape_and_reference_sizes():
    head = ValueHead(64)
    sizes = [m.out_features for m in head.net if isinstance(m, torch.nn.Linear)]
    assert sizes == [1024, 512, 1]
    assert head(torch.zeros(3, 5, 64)).shape == (3, 5)

import pytest

from tokenmill import SamplingParams


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(seed=-1), "seed"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature="hot"), "temperature"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_params_name_param_value_and_range(kwargs, name):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith(name) and repr(next(iter(kwargs.values()))) in msg and "must be" in msg


def test_stop_string_normalized():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy

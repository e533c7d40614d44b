import pytest

from tokenmill import SamplingParams


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-5), "top_k"), (dict(min_p=2), "min_p"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(seed=-1), "seed"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(temperature="hot"), "temperature"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(min_tokens=True), "min_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"), (dict(skip_special_tokens=None), "skip_special_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=5), "allowed_token_ids"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=2.5), "truncate_prompt_tokens"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(prompt_logprobs=True), "prompt_logprobs"),
    (dict(bad_words="Paris"), "bad_words"), (dict(bad_words=["ok", " "]), "bad_words"),
    (dict(bad_words=[3]), "bad_words"), (dict(bad_words_token_ids=[5]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids"),
    (dict(bad_words_token_ids=[[1, -1]]), "bad_words_token_ids"),
])
def test_invalid_params_name_param_value_and_range(kwargs, name):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert msg.startswith(name) and repr(next(iter(kwargs.values()))) in msg and "must be" in msg


def test_stop_string_normalized():
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize("bias, wrong", [
    ([5, 1.0], "[5, 1.0]"), ({"5": 1.0}, "'5'"), ({-1: 1.0}, "-1"), ({True: 1.0}, "True"),
    ({5: 100.5}, "100.5"), ({5: -101}, "-101"), ({5: float("nan")}, "nan"), ({5: float("inf")}, "inf"),
    ({5: 10 ** 400}, "1" + "0" * 30), ({5: "up"}, "'up'"), ({5: True}, "True"),
])
def test_invalid_logit_bias_names_the_entry_and_what_is_allowed(bias, wrong):
    with pytest.raises(ValueError) as e:
        SamplingParams(logit_bias=bias)
    msg = str(e.value)
    assert msg.startswith("logit_bias") and wrong in msg and "must be" in msg


def test_logit_bias_normalized_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={5: 100, 7: -100, 0: 0.5})
    assert p.logit_bias == {5: 100.0, 7: -100.0, 0: 0.5} and all(type(v) is float for v in p.logit_bias.values())
    assert SamplingParams(logit_bias={}).logit_bias is None  # an empty map costs the sampler nothing
    p.verify_vocab(8)
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 6\) .*got \[7\]"):
        p.verify_vocab(6)


def test_allowed_token_ids_normalized_and_checked_against_the_vocabulary():
    p = SamplingParams(allowed_token_ids=(7, 3, 7))
    assert p.allowed_token_ids == [3, 7]
    p.verify_vocab(8)
    with pytest.raises(ValueError, match=r"allowed_token_ids token ids must be in \[0, 6\) .*got \[7\]"):
        p.verify_vocab(6)


def test_bad_words_token_ids_normalized_and_checked_against_the_vocabulary():
    p = SamplingParams(bad_words_token_ids=[(4, 5), [2]])
    assert p.bad_words_token_ids == [[4, 5], [2]]
    p.verify_vocab(6)
    with pytest.raises(ValueError, match=r"bad_words_token_ids token ids must be in \[0, 5\) .*got \[5\]"):
        p.verify_vocab(5)

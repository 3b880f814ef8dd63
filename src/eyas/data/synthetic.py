"""Synthetic two-turn user prompts in the spirit of UltraChat: the source `packaged:synthetic`.

Why: a drafter learns the target's distribution on the text it is trained on. Trained only on
ShareGPT/chitchat answers it sees little of what a chat benchmark asks for (essays, roleplay,
puzzles, arithmetic, code, extraction from a passage), and its acceptance drops there. This
module writes user turns of those kinds from hand-written tables (stdlib only, deterministic
given a seed); the target model answers them later, replacing the "." placeholders.

`contaminated` lets the caller drop prompts that share an n-word span with the benchmark's own
questions, so that training never sees benchmark text: `packaged_synthetic` (eyas.data.sources,
where the packaged texts are read) always leaves out those that share eight words in a row with
MT-bench (the eval prompts eyas ships).

On SmolLM2 these prompts were the data kind that mattered most (+0.3 MT-bench chain tau over
regenerated ShareGPT and chitchat alone; docs/train.md).
"""

from __future__ import annotations

import random
import re
from typing import Callable

FAMILIES: tuple[str, ...] = ("writing", "roleplay", "stem", "humanities", "reasoning", "math",
                             "coding", "extraction")

# ----------------------------------------------------------------------------------------- topics
# Concrete noun phrases that read well after "about", "explain", "discuss".
SCIENCE = (
    "how black holes form from collapsing stars", "why the sky looks blue during the day",
    "the difference between nuclear fission and fusion", "how superconductors carry current without loss",
    "the photoelectric effect and why it mattered", "how lasers produce a coherent beam of light",
    "the physics of a bicycle staying upright", "why ice floats on water", "how rainbows form",
    "the principle behind noise-cancelling headphones", "entropy and the arrow of time",
    "how GPS depends on relativity", "the chemistry of baking bread", "how batteries store energy",
    "why some metals rust and others do not", "how catalysts speed up reactions",
    "the role of pH in swimming pool maintenance", "how soap removes grease",
    "the chemistry behind fireworks colours", "why onions make people cry",
    "how plastics are made from oil", "the periodic table's organisation", "how photosynthesis works",
    "how vaccines train the immune system", "the life cycle of a monarch butterfly",
    "how DNA is copied when a cell divides", "why antibiotics stop working against some bacteria",
    "how bees communicate through dance", "the role of gut bacteria in digestion",
    "how octopuses change colour", "the evolution of whales from land mammals",
    "how coral reefs are built", "why we need sleep", "how migratory birds navigate",
    "the way forests recover after wildfires", "how the human heart pumps blood",
    "the life cycle of a star like the Sun", "how astronomers find planets around other stars",
    "why the Moon always shows the same face to Earth", "the search for life on Mars",
    "what causes the seasons", "how solar eclipses happen", "the Big Bang theory and its evidence",
    "how the James Webb telescope sees in infrared", "why Pluto was reclassified as a dwarf planet",
    "the rings of Saturn", "how earthquakes are measured", "how volcanoes form",
    "the water cycle", "how glaciers shape valleys", "plate tectonics and the drifting continents",
    "how hurricanes form over warm oceans", "why deserts get cold at night", "how caves form in limestone",
    "the formation of fossil fuels", "how tsunamis travel across oceans",
    "how the kidneys filter blood", "the causes of type 2 diabetes", "how anaesthesia works",
    "the difference between viruses and bacteria", "how the body heals a broken bone",
    "why high blood pressure is dangerous", "how allergies develop", "the basics of CRISPR gene editing",
    "how MRI scanners create images", "the placebo effect", "how the brain forms memories",
    "why exercise improves mood", "how hearing works", "the science of jet lag",
    "how the eye focuses light", "why fevers help fight infection", "how antidepressants are thought to work",
    "the spread of antibiotic resistance in hospitals", "how blood types were discovered", "the chemistry of smell",
    "how plants defend themselves against insects", "why leaves change colour in autumn", "how sound travels through air",
    "the discovery of penicillin", "how nuclear reactors are cooled", "how the ozone layer protects life",
    "the genetics of eye colour", "how tides are caused by the Moon", "how mushrooms spread underground",
)
TECH = (
    "how the internet routes a message", "how public-key encryption works",
    "the basics of machine learning", "how search engines rank pages", "the history of the smartphone",
    "how a CPU executes instructions", "the difference between RAM and storage",
    "cloud computing for small businesses", "how recommendation algorithms work",
    "the basics of blockchain technology", "open-source software and its business models",
    "how self-driving cars perceive the road", "password managers", "two-factor authentication",
    "how video compression works", "the rise of electric cars", "how 3D printing works",
    "quantum computing in plain terms", "the ethics of facial recognition",
    "how large language models are trained", "the Internet of Things in the home",
    "how Wi-Fi signals travel through walls", "version control with Git",
    "how a compiler turns code into a program", "the history of video games",
    "cybersecurity habits for everyday users", "how databases keep data consistent",
    "the energy use of data centres", "how touchscreens detect a finger", "drones in agriculture",
    "how satellites stay in orbit", "the right to repair electronics", "how QR codes store information",
    "smart thermostats and energy savings", "how noise is removed from photos",
    "how spam filters decide what is junk", "the history of the World Wide Web", "how electric grids balance supply and demand",
    "how streaming services deliver video smoothly", "the basics of web accessibility", "how voice assistants understand speech",
    "how phishing attacks trick people", "the history of programming languages", "how digital cameras capture colour",
    "robots in warehouses", "how online maps estimate travel time", "backing up family photos safely",
    "how e-readers display text", "the basics of home networking", "how captchas tell people from bots",
    "how weather forecasts are computed", "the history of the computer mouse", "how solar-powered calculators work",
)
HISTORY = (
    "the causes of the French Revolution", "the fall of the Western Roman Empire",
    "the invention of the printing press", "the Silk Road trade routes", "the Industrial Revolution in Britain",
    "the Meiji Restoration in Japan", "the construction of the Great Wall of China",
    "the Black Death in medieval Europe", "the American civil rights movement",
    "the partition of India in 1947", "the Cold War space race", "the rise of the Mongol Empire",
    "ancient Egyptian pyramid building", "the Renaissance in Florence", "the Protestant Reformation",
    "the abolition of the transatlantic slave trade", "the Inca road system", "the Ottoman Empire's expansion",
    "the fall of the Berlin Wall", "the Mali Empire and Mansa Musa", "the Opium Wars",
    "the Mexican Revolution", "the Viking voyages to North America", "the end of apartheid in South Africa",
    "the Marshall Plan after the Second World War", "the Haitian Revolution", "the Aztec city of Tenochtitlan",
    "the Great Depression", "the Russian Revolution of 1917", "the unification of Germany in 1871",
    "the decolonisation of Africa", "the Library of Alexandria", "the Magna Carta",
    "the Cuban Missile Crisis", "the Ming dynasty treasure voyages", "the spread of Buddhism across Asia",
    "the women's suffrage movement", "the history of the Olympic Games", "the Dust Bowl of the 1930s",
    "the Harappan civilisation of the Indus Valley",
    "the Hundred Years' War", "the Korean War", "the history of the Suez Canal", "the Zulu kingdom under Shaka",
    "the Spanish conquest of the Philippines", "the Khmer Empire and Angkor Wat", "the Irish potato famine",
    "the independence of Latin American nations in the nineteenth century", "the Phoenician alphabet",
    "the Byzantine Empire's final centuries", "the history of coffee houses in Europe", "the Great Leap Forward",
    "the Scientific Revolution", "the history of the Hanseatic League", "the trade of the Swahili coast",
)
PHILOSOPHY_LIT_ARTS = (
    "Plato's allegory of the cave", "utilitarianism and its critics", "free will and determinism",
    "Stoic philosophy in modern life", "the trolley problem", "existentialism and the search for meaning",
    "Confucian ideas about family and duty", "the ethics of lying", "what makes a life go well",
    "the mind-body problem", "social contract theory", "moral relativism",
    "the themes of Shakespeare's Hamlet", "the use of symbolism in The Great Gatsby",
    "magical realism in Latin American fiction", "the hero's journey as a story structure",
    "the role of the narrator in Wuthering Heights", "dystopian novels and their warnings",
    "the sonnet as a poetic form", "the influence of Greek myths on modern stories",
    "why Don Quixote is still read", "the appeal of detective fiction", "the oral tradition of epic poetry",
    "Impressionist painting", "the architecture of Gothic cathedrals", "the history of jazz",
    "how film editing shapes emotion", "the Harlem Renaissance", "minimalism in music",
    "the role of colour in film", "street art as public expression", "the evolution of hip-hop",
    "Japanese woodblock prints", "the history of the symphony orchestra", "silent film comedy",
    "how a museum decides what to exhibit", "the importance of folk songs", "the Bauhaus design school",
    "the art of the documentary film", "why some songs get stuck in our heads",
    "the poetry of Rumi", "the novels of Jane Austen", "Greek tragedy and its chorus", "the rise of the graphic novel",
    "the history of ballet", "Frida Kahlo's self-portraits", "the blues and its roots", "the invention of photography",
    "Kant's idea of duty", "Buddhist ideas about suffering", "the ethics of eating meat", "what makes a good translation",
)
ECON_LAW_SOCIETY = (
    "how inflation affects savings", "supply and demand in housing markets", "the basics of index funds",
    "compound interest for beginners", "how central banks set interest rates", "the gig economy",
    "universal basic income", "how tariffs affect consumers", "the economics of minimum wage laws",
    "how startups raise money", "budgeting on an irregular income", "the causes of the 2008 financial crisis",
    "how credit scores work", "the pros and cons of cryptocurrency", "how supermarkets price products",
    "the role of small businesses in a local economy", "how insurance spreads risk",
    "the separation of powers in a democracy", "how a bill becomes law", "freedom of speech online",
    "jury trials", "how elections are run", "the role of international law", "privacy rights and data collection",
    "the purpose of antitrust regulation", "how the United Nations works", "voting systems and their trade-offs",
    "urbanisation and the growth of megacities", "the ageing of populations", "how social media shapes opinions",
    "the digital divide", "public transport in big cities", "volunteering in the community",
    "immigration and the labour market", "the role of a free press",
    "how advertising influences children", "the economics of professional sports", "fair trade coffee",
    "the role of trade unions", "how a company writes a business plan", "the history of paper money",
    "why housing is unaffordable in many cities", "the economics of tourism", "how local governments spend taxes",
    "the rules of copyright and fair use",
)
MIND_EDU_LIFE = (
    "how habits form", "cognitive biases in decision making", "the psychology of procrastination",
    "how stress affects the body", "growth mindset", "why people conform to groups", "the stages of grief",
    "how children learn language", "introversion and extroversion", "the science of motivation",
    "the benefits of learning a second language", "homework in primary school", "online learning",
    "the value of a liberal arts education", "how to study effectively for exams", "standardised testing",
    "a remote-work productivity routine", "preparing for a job interview", "negotiating a salary",
    "switching careers in your thirties", "managing a team for the first time", "giving constructive feedback",
    "keeping a long-distance friendship alive", "resolving arguments with a roommate",
    "planning a wedding on a small budget", "raising a teenager", "caring for an ageing parent",
    "decluttering a small apartment", "building a morning routine", "saving for a first home",
    "starting a side business", "dealing with burnout", "making friends in a new city",
    "setting boundaries at work", "choosing a university course", "public speaking nerves",
    "learning to play an instrument as an adult", "teaching children about money", "the first year of parenthood",
    "moving abroad for work", "keeping a plant alive indoors", "adopting a rescue dog", "writing a personal budget",
    "how memory changes with age", "the psychology of first impressions", "coping with loneliness",
)
PLACES_FOOD_SPORT_ENV = (
    "a weekend trip to Lisbon", "backpacking through Patagonia", "the food markets of Bangkok",
    "visiting Kyoto's temples", "a road trip across Iceland", "travelling by train across Canada",
    "the canals of Amsterdam", "a first visit to Morocco", "hiking in the Scottish Highlands",
    "the national parks of Kenya", "island hopping in Greece", "how to travel sustainably",
    "packing light for a two-week trip", "the geography of the Nile", "why Venice is sinking",
    "how to make fresh pasta", "the history of chocolate", "fermenting vegetables at home",
    "cooking healthy meals on a budget", "the regional cuisines of India", "sourdough starters",
    "the difference between baking soda and baking powder", "a vegetarian dinner party menu",
    "the tea ceremony in Japan", "street food around the world", "how coffee is roasted",
    "training for a first marathon", "the rules of cricket", "strength training for beginners",
    "the history of football's World Cup", "yoga for back pain", "the benefits of swimming",
    "how to stay hydrated during sport", "the mental side of competitive sport", "cycling to work",
    "climate change and sea-level rise", "plastic pollution in the oceans", "renewable energy from wind",
    "solar panels for homes", "deforestation in the Amazon", "protecting endangered species",
    "urban gardening", "reducing household food waste", "recycling and its limits",
    "the value of wetlands", "composting at home", "electric buses in cities", "water scarcity",
    "rewilding projects in Europe", "the carbon footprint of fast fashion",
    "a food tour of Mexico City", "walking the Camino de Santiago", "the geography of the Himalayas",
    "a family holiday in New Zealand", "the history of the croissant", "spices of the Caribbean kitchen",
    "meal prepping for a busy week", "the basics of knife skills", "how cheese is aged", "the rules of tennis",
    "stretching before and after exercise", "the history of the Tour de France", "bird watching for beginners",
    "air pollution in large cities", "bees and pollinator decline", "the Great Barrier Reef's bleaching",
)
STEM_TOPICS = SCIENCE + TECH
HUMANITIES_TOPICS = HISTORY + PHILOSOPHY_LIT_ARTS + ECON_LAW_SOCIETY
TOPICS = STEM_TOPICS + HUMANITIES_TOPICS + MIND_EDU_LIFE + PLACES_FOOD_SPORT_ENV

PAIRS = (
    ("mitosis", "meiosis"), ("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"),
    ("stocks", "bonds"), ("renting", "buying a home"), ("solar power", "wind power"),
    ("Python", "JavaScript"), ("SQL databases", "NoSQL databases"), ("TCP", "UDP"),
    ("an ebook", "a printed book"), ("capitalism", "socialism"), ("Stoicism", "Epicureanism"),
    ("the Roman Republic", "the Roman Empire"), ("a comet", "an asteroid"), ("DNA", "RNA"),
    ("a hurricane", "a tornado"), ("baroque music", "classical-era music"), ("a novel", "a film adaptation"),
    ("socialising online", "socialising in person"), ("running", "cycling"), ("tea", "coffee"),
    ("a Roth IRA", "a traditional IRA"), ("nuclear power", "natural gas"), ("machine learning", "traditional programming"),
    ("weightlifting", "yoga"), ("city life", "country life"), ("a president", "a prime minister"),
    ("civil law", "criminal law"), ("a fixed-rate mortgage", "a variable-rate mortgage"),
)
DEBATES = (
    "whether homework should be banned", "whether zoos are ethical", "a four-day working week",
    "whether social media does more harm than good", "lowering the voting age to sixteen",
    "whether museums should return artefacts to their countries of origin", "nuclear power as a climate solution",
    "whether art made by AI is real art", "school uniforms", "taxing sugary drinks",
    "whether space exploration is worth the cost", "banning cars from city centres",
    "whether history should be judged by today's values", "compulsory national service",
    "whether college should be free", "remote work versus office work", "genetically modified crops",
    "whether famous people owe us their privacy", "a tax on very large fortunes", "animal testing in medicine",
)

# ----------------------------------------------------------------------------------------- writing
WRITING = (
    "Write a blog post about {topic}{limit}.", "Write a persuasive essay arguing for more attention to {topic}{limit}.",
    "Write a short story in which a character's life is changed by {topic}{limit}.",
    "Write a poem inspired by {topic}.", "Write a friendly email to a colleague recommending they read up on {topic}{limit}.",
    "Write a five-minute speech for a school assembly about {topic}.",
    "Write a product description for a new board game themed around {topic}{limit}.",
    "Write a cover letter for a job at a small organisation that works on {topic}{limit}.",
    "Write a social media post announcing a free public talk on {topic}. Keep it lively.",
    "Draft a newsletter introduction on {topic}{limit}.", "Write a letter to the editor of a local paper about {topic}{limit}.",
    "Write a series of three haiku about {topic}.", "Write the opening scene of a screenplay set around {topic}.",
    "Write an upbeat radio advertisement script for a workshop on {topic}.",
    "Write a short opinion column on {topic}{limit}.", "Write a children's picture-book text about {topic}{limit}.",
)
LIMITS = ("", "", "", " in under 150 words", " in under 250 words", " in about 300 words",
          " in no more than 100 words", " in two short paragraphs", " in three paragraphs", " in four paragraphs")
WRITING_FOLLOWUPS = (
    "Rewrite it as a limerick.", "Now give it a more dramatic ending.", "Make it half as long without losing the key idea.",
    "Rewrite it for an audience of retired engineers.", "Give it a catchier title and a stronger first sentence.",
    "Now write it from the point of view of someone who disagrees.", "Add a touch of humour throughout.",
    "Rewrite it so that it rhymes.",
)

# ----------------------------------------------------------------------------------------- roleplay
PERSONAS = (
    "a lighthouse keeper in the year 1900", "a medieval blacksmith", "a museum tour guide", "a barista at a busy cafe",
    "a detective in 1920s Chicago", "a park ranger in Yellowstone", "a settler on the first Mars colony", "a wine sommelier",
    "a personal trainer", "a career counsellor", "a tax accountant in April", "a kindergarten teacher",
    "a tech support agent", "a travel agent", "the head chef of a busy bistro", "an astronaut on the space station",
    "a senator in ancient Rome", "a small-town librarian", "a zookeeper", "a pirate captain", "a fashion designer",
    "a chess grandmaster", "a retired firefighter", "a startup founder pitching to investors", "a wildlife photographer",
    "a nurse on a night shift", "a village baker", "an air traffic controller", "a court interpreter",
    "a marine biologist", "a robot butler", "a time traveller from the year 2300", "a dragon who guards a library",
    "a football commentator", "a real-estate agent", "a late-night radio DJ", "a beekeeper", "a mountain guide",
    "a shopkeeper in a fantasy video game", "a Victorian-era inventor",
)
ROLE_OPENERS = ("Pretend you are {p}.", "You are {p}.", "Play the role of {p}.", "For this chat, take on the character of {p}.",
                "Let's do some roleplay: you are {p}.")
ROLE_TASKS = (
    "Describe your typical morning in a few vivid paragraphs.", "A newcomer asks your advice about {topic}. Answer in character.",
    "Tell me what you find most rewarding and most frustrating about your work.",
    "Write a diary entry about an unexpected visitor.", "Greet me as a customer and recommend something, staying in character.",
    "Tell me about the strangest thing that happened to you last week.", "Convince me to try the thing you love most.",
    "Give me three rules you live by and explain why.", "Explain {topic} the way you would to a friend over dinner.",
    "Complain, in character, about a recent change at work.", "Describe the tools you rely on and how you use them.",
)
ROLE_SUFFIXES = ("", "", " Keep it under 150 words.", " Use plenty of sensory detail.", " Include one line of dialogue.",
                 " Speak in the first person throughout.", " Let your personality show in every sentence.")
ROLE_FOLLOWUPS = (
    "Staying in character, what would you say to someone who doubts you?", "Still in character: what do you regret most?",
    "Stay in character and tell me how you got started.", "Now break character and explain what research would make this portrayal more accurate.",
    "Stay in character: a rival has just walked in. What do you say to them?",
)

# ----------------------------------------------------------------------------------------- stem / humanities
AUDIENCES = ("a ten-year-old", "a first-year university student", "a curious teenager", "a retired lawyer",
             "a busy parent", "a journalist on a deadline", "someone who left school at sixteen", "a nurse",
             "a software developer", "my grandmother")
STEM = (
    "Explain {topic} to {audience}.", "How would you explain {topic} to {audience}?",
    "Give an expert-level overview of {topic}, including open questions.", "What are common misconceptions about {topic}?",
    "Walk me through {topic} step by step.", "Why does {topic} matter in everyday life?",
    "Give me a short, accurate summary of {topic} and suggest two ways to learn more.",
    "What are the pros and cons of {pair0} compared with {pair1}?", "Compare {pair0} and {pair1} in a short table, then explain the biggest difference.",
    "How would you explain the difference between {pair0} and {pair1} to a high-school class?",
)
HUMANITIES = (
    "Analyse {topic} and its long-term consequences.", "Discuss the significance of {topic}.",
    "How have scholars interpreted {topic} in different ways?", "What lessons does {topic} hold for people today?",
    "Write a balanced analysis of {topic} in about {words} words.", "Argue both sides of the debate over {debate}, then give your own view.",
    "What are the strongest arguments for and against {debate}?", "Summarise the key ideas behind {topic} and one criticism of them.",
    "Which three facts would you want every student to know about {topic}, and why?",
)
STEM_SUFFIXES = ("", "", "", " Use one everyday analogy.", " Keep it under 200 words.", " Include a worked example.",
                 " End with a question that checks understanding.", " Avoid jargon.", " Use short headings.",
                 " Mention one common mistake people make.")
HUMANITIES_SUFFIXES = ("", "", "", " Refer to at least two specific examples.", " Keep it under 250 words.",
                       " Structure it with an introduction, body and conclusion.", " Use bullet points for the main arguments.",
                       " Consider both economic and cultural factors.", " End with an open question for discussion.")
EXPLAIN_FOLLOWUPS = (
    "Now explain it to a specialist, using technical vocabulary.", "Suggest a simple experiment or demonstration that shows this.",
    "What is still unknown or debated about this?", "Give an analogy that makes the main idea stick.",
)
HUMANITIES_FOLLOWUPS = (
    "What would a critic of your view say?", "Name two primary sources someone could read on this.",
    "How does this compare with a similar case from another country or era?", "Which of your points is the weakest, and why?",
)

# ----------------------------------------------------------------------------------------- generic follow-ups
GENERIC_FOLLOWUPS = (
    "Rewrite your answer for a ten-year-old.", "Summarize your previous response in three bullet points.",
    "Now make it more formal.", "Now make it more casual and friendly.",
    "Translate the first paragraph into French.", "Translate the first paragraph into Spanish.", "Give two concrete examples.",
    "Cut it down to about half its length.", "Which part of your answer are you least sure about, and why?",
    "Add a short conclusion with one practical takeaway.", "Turn your answer into a numbered list.",
    "Write a catchy title for it.", "Rewrite it in the style of a newspaper article.",
    "Put the main points in a table.", "Explain the most technical term you used in plain words.",
    "Write three quiz questions based on your answer.", "Say the same thing in exactly four sentences.",
    "What would you add if you had twice the space?",
)
OPINION_FOLLOWUPS = GENERIC_FOLLOWUPS + ("What are the weaknesses of your argument?", "How would someone who disagrees respond?")

# ----------------------------------------------------------------------------------------- reasoning
FEMALE = ("Maria", "Aisha", "Chloe", "Priya", "Lena", "Sofia", "Hana", "Grace", "Elena", "Zoe", "Nadia", "Ruth",
          "Mei", "Ingrid", "Fatima", "Olivia", "Yuki", "Amara", "Clara", "Ines")
MALE = ("James", "Omar", "Lucas", "Ravi", "Tom", "Diego", "Kenji", "Noah", "Ivan", "Samuel", "Ahmed", "Felix",
        "Leo", "Mateo", "Arjun", "Ben", "Hugo", "Kwame", "Pablo", "Oscar")
NAMES = FEMALE + MALE
COMPARATIVES = (("taller than", "tallest", "shortest"), ("older than", "oldest", "youngest"),
                ("faster than", "fastest", "slowest"), ("richer than", "richest", "poorest"),
                ("heavier than", "heaviest", "lightest"))
CATEGORIES = ("poets", "gardeners", "pilots", "chess players", "vegetarians", "musicians", "runners", "teachers",
              "painters", "engineers", "early risers", "cat owners")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
RIDDLES = (
    "I grow shorter the longer I live, and I cry wax as I go. What am I?",
    "The more of me you take, the more you leave behind you on the path. What am I?",
    "I have a face and two hands but cannot wave or smile. What am I?",
    "What gets wetter the more it dries?", "I am full of holes yet I hold water in the kitchen. What am I?",
    "What can run all day without legs and has a mouth but never eats?",
    "A shop sells one for 1 coin, ten for 2 coins and a hundred for 3 coins. What is being sold?",
    "What belongs to you, but your friends use it far more often than you do?",
)
REASONING_FOLLOWUPS = (
    "Explain how you could check your answer systematically.", "Write a harder puzzle of the same kind and give its solution.",
    "Where might someone reasoning quickly go wrong here?", "Explain your reasoning as a numbered chain of steps.",
)

# ----------------------------------------------------------------------------------------- math
MATH_FOLLOWUPS = (
    "Check your answer using a different method.", "Explain each step as if to a student who finds algebra hard.",
    "Write a similar problem with a different setting and solve it.", "What general formula covers problems like this one?",
)
ITEMS = ("jacket", "bicycle", "laptop", "pair of boots", "coffee machine", "desk lamp", "backpack", "tent", "camera")

# ----------------------------------------------------------------------------------------- coding
LANGUAGES = ("Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C#")
CODING_TASKS = (
    "checks whether a string is a palindrome, ignoring spaces and case", "counts the vowels in a sentence",
    "returns the second largest number in a list", "merges two sorted lists into one sorted list",
    "removes duplicate values from a list while keeping the original order", "converts a temperature from Celsius to Fahrenheit and back",
    "checks whether a number is prime", "returns all prime numbers below a given limit using a sieve",
    "reverses the order of words in a sentence", "computes the greatest common divisor of two integers",
    "flattens a nested list of arbitrary depth", "groups a list of words by their first letter",
    "validates that a string looks like an email address", "converts a Roman numeral to an integer",
    "converts an integer to its binary representation without library helpers",
    "finds the longest word in a paragraph", "checks whether two strings are anagrams of each other",
    "rotates a square matrix by 90 degrees", "implements a stack with push, pop and peek",
    "implements a simple queue using two stacks", "performs binary search on a sorted array",
    "computes the running average of a stream of numbers", "parses a CSV line that may contain quoted commas",
    "counts how often each word appears in a text and prints the top ten", "generates a random password of a given length",
    "formats a number of seconds as hours, minutes and seconds", "finds all pairs in a list that add up to a target",
    "checks whether parentheses, brackets and braces in a string are balanced", "computes the factorial of a number iteratively",
    "capitalises the first letter of every word in a string", "finds the missing number in a list containing 1 to n",
    "implements a basic LRU cache", "computes the edit distance between two strings",
    "returns the transpose of a matrix", "checks whether a year is a leap year",
    "compresses a string such as aaabcc into a3b1c2", "splits a list into chunks of a given size",
    "finds the most frequent character in a string", "computes simple interest and compound interest for a loan",
    "simulates rolling two dice a thousand times and reports the frequencies", "sorts a list of people by age and then by name",
    "converts a dictionary of settings into a query string for a URL", "implements bubble sort and counts the swaps",
    "reads numbers from a file and prints their sum, minimum and maximum", "checks whether a linked list has a cycle",
    "builds a histogram of word lengths in a text", "calculates the day of the week for a given date",
)
SQL_TASKS = (
    "lists the five customers who spent the most in the last year", "finds employees who earn more than their manager",
    "counts orders per month for the current year", "finds products that have never been ordered",
    "returns the average rating of each book with at least ten reviews", "deletes duplicate rows from a contacts table, keeping the oldest",
    "shows each department's highest-paid employee", "computes a running total of daily sales",
)
BASH_TASKS = (
    "renames every .jpeg file in a folder to .jpg", "prints the ten largest files under a directory",
    "backs up a folder into a dated tar.gz archive", "counts the lines of code in all .py files recursively",
    "checks whether a website responds and logs the result with a timestamp", "deletes log files older than 30 days",
)
CODING = (
    "Write a {lang} function that {task}.", "Write a {lang} program that {task}. Include a short usage example.",
    "How would you write code in {lang} that {task}? Please show the code and explain it briefly.",
    "Implement a {lang} function that {task}, and state its time complexity.",
    "I'm learning {lang}. Could you show me clean, well-commented code that {task}?",
    "Write a {lang} function that {task}, plus three unit tests for it.",
)
CODE_SUFFIXES = ("", "", "", " Keep it under 30 lines.", " Avoid external libraries.", " Add comments for a beginner.",
                 " Handle empty input sensibly.", " Include an example call and its output.")
SQL_DIALECTS = ("", "", " for PostgreSQL", " for MySQL", " for SQLite")
CODING_FOLLOWUPS = (
    "Now add error handling and tests.", "Can you make it faster or use less memory? Explain the trade-off.",
    "Rewrite it in {other}.", "Add type hints or type annotations and docstrings.",
    "What edge cases could break it, and how would you handle them?",
)

# ----------------------------------------------------------------------------------------- extraction
EXTRACTION = (
    "Read the passage below and list every person, place and organisation it mentions.\n\n{passage}",
    "Summarize the following text in {k} bullet points.\n\n{passage}",
    "Extract every number and date from this text and say what each one refers to.\n\n{passage}",
    "Convert the facts stated in the passage below into a JSON object. Choose sensible keys.\n\n{passage}",
    "Turn the key facts of this passage into a two-column table.\n\n{passage}",
    "Based only on the text below, what is the main point, and what evidence supports it?\n\nText: {passage}",
    "Here is a passage:\n\n{passage}\n\nWrite a one-sentence headline for it and list three keywords.",
    "Describe the tone of the following passage and quote the phrases that show it.\n\n{passage}",
    "{passage}\n\nFrom the text above, what questions are left unanswered? List up to {k}.",
)
EXTRACTION_FOLLOWUPS = (
    "Now output it as JSON.", "Now present the same information as a Markdown table.", "Shorten it to a single sentence.",
    "Which item you extracted matters most, and why?", "Now write two questions a reader could answer from the passage, with answers.",
)


# ========================================================================================= generators
Pair = tuple[str, str]


def _followup(rng: random.Random, specific: tuple[str, ...], generic_share: float = 0.5,
              generic: tuple[str, ...] = GENERIC_FOLLOWUPS) -> str:
    """A family-specific follow-up or, with probability `generic_share`, a generic one."""
    return rng.choice(generic) if rng.random() < generic_share else rng.choice(specific)


def _writing(rng: random.Random, passages: list[str]) -> Pair:
    first = rng.choice(WRITING).format(topic=rng.choice(TOPICS), limit=rng.choice(LIMITS))
    return first, _followup(rng, WRITING_FOLLOWUPS, generic=OPINION_FOLLOWUPS)


def _roleplay(rng: random.Random, passages: list[str]) -> Pair:
    first = rng.choice(ROLE_OPENERS).format(p=rng.choice(PERSONAS)) + " " + rng.choice(ROLE_TASKS).format(topic=rng.choice(TOPICS))
    first += rng.choice(ROLE_SUFFIXES)
    return first, _followup(rng, ROLE_FOLLOWUPS, 0.3)


def _stem(rng: random.Random, passages: list[str]) -> Pair:
    pair = rng.choice(PAIRS)
    first = rng.choice(STEM).format(topic=rng.choice(STEM_TOPICS), audience=rng.choice(AUDIENCES), pair0=pair[0], pair1=pair[1])
    return first[0].upper() + first[1:] + rng.choice(STEM_SUFFIXES), _followup(rng, EXPLAIN_FOLLOWUPS)


def _humanities(rng: random.Random, passages: list[str]) -> Pair:
    first = rng.choice(HUMANITIES).format(topic=rng.choice(HUMANITIES_TOPICS), debate=rng.choice(DEBATES),
                                          words=rng.choice((200, 300, 400, 500)))
    return first + rng.choice(HUMANITIES_SUFFIXES), _followup(rng, HUMANITIES_FOLLOWUPS, generic=OPINION_FOLLOWUPS)


def _reasoning(rng: random.Random, passages: list[str]) -> Pair:
    """Puzzles with random names and numbers: the answer has to be worked out, not recalled."""
    kind = rng.randrange(9)
    if kind == 0:  # ordering
        people = rng.sample(NAMES, rng.randint(3, 5))
        comp, most, least = rng.choice(COMPARATIVES)
        facts = [f"{a} is {comp} {b}." for a, b in zip(people, people[1:])]
        rng.shuffle(facts)
        first = " ".join(facts) + f" Who is the {rng.choice((most, least))}, and what is the full order?"
        follow = f"Now suppose {people[0]} and {people[-1]} swap places in the order. Which statements become false?"
    elif kind == 1:  # family relations
        w, d, g = rng.sample(FEMALE, 3)
        m, c = rng.sample(MALE, 2)
        first = rng.choice((
            f"{w} is the mother of {m}. {m} is the father of {c}. How is {w} related to {c}?",
            f"{m} and {d} are siblings. {d} has a son called {c}. What is {m} to {c}?",
            f"{w}'s brother is {m}. {m}'s daughter is {d}. {d}'s child is {c}. How are {w} and {c} related?"))
        follow = f"Add one more person: {g} is {c}'s only cousin's grandmother. Draw the family tree as text."
    elif kind == 2:  # knights and knaves
        a, b = rng.sample(NAMES, 2)
        claim = rng.choice((f"{b} is a knave.", "We are both knaves.", f"{b} and I are the same type.", "At least one of us is a knave."))
        first = (f"On an island, knights always tell the truth and knaves always lie. {a} says: \"{claim}\" "
                 f"{b} says nothing. What can you conclude about {a} and {b}?")
        follow = f"What if {b} then says: \"{a} is a knight\"? Does that change your conclusion?"
    elif kind == 3:  # rates of work
        a, b, c = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 10)
        d, e = rng.randint(2, 12), rng.randint(2, 15)
        first = (f"If {a} workers can build {b} sheds in {c} days, how many days would {d} workers need to build {e} sheds, "
                 "working at the same rate?")
        follow = f"Now say only {max(1, d - 1)} workers are available for the first half of the job. How long does it take?"
    elif kind == 4:  # weekdays
        ago, ahead, day = rng.randint(2, 40), rng.randint(2, 100), rng.choice(WEEKDAYS)
        first = f"If {ago} days ago it was a {day}, what day of the week will it be {ahead} days from today?"
        follow = f"And what day of the week was it {ahead + ago * 3} days before today?"
    elif kind == 5:  # pigeonhole
        r, b, g = rng.randint(3, 15), rng.randint(3, 15), rng.randint(0, 8)
        extra = f", {g} green socks" if g else ""
        first = (f"A drawer holds {r} red socks{extra} and {b} blue socks, all mixed up. In the dark, how many socks must you "
                 "take out to be sure of having a matching pair? And to be sure of two red ones?")
        follow = "Now the socks are replaced by gloves, which come as left and right. How does the answer change?"
    elif kind == 6:  # syllogism
        x, y, z = rng.sample(CATEGORIES, 3)
        q1 = rng.choice(("All", "Some", "No"))
        first = (f"{q1} {x} are {y}. Some {y} are {z}. Does it follow that some {x} are {z}? "
                 "Explain with a diagram in words.")
        follow = "What extra premise would make the conclusion certain?"
    elif kind == 7:  # clock angle
        h, mm = rng.randint(1, 12), rng.choice(range(0, 60, 5))
        first = f"What is the smaller angle between the hour hand and the minute hand of a clock at {h}:{mm:02d}?"
        follow = f"At what time between {h}:00 and {h % 12 + 1}:00 do the two hands point in exactly the same direction?"
    else:  # ages or riddle
        if rng.random() < 0.3:
            return rng.choice(RIDDLES), _followup(rng, ("Explain why that is the answer.", "Write a new riddle of your own and give its answer."), 0.2)
        a, b = rng.sample(NAMES, 2)
        young, gap = rng.randint(3, 40), rng.randint(2, 30)
        first = f"{a} and {b} have ages that add up to {2 * young + gap}. {a} is {gap} years older than {b}. How old is each of them?"
        follow = f"In how many years will {a} be exactly {rng.choice(('twice', 'one and a half times'))} as old as {b}, if ever?"
    return first, (follow if rng.random() < 0.5 else rng.choice(REASONING_FOLLOWUPS))


def _math(rng: random.Random, passages: list[str]) -> Pair:
    """Word problems and equations with random numbers; the follow-up often changes one number."""
    kind = rng.randrange(10)
    if kind == 0:
        item, price, disc, tax = rng.choice(ITEMS), rng.randrange(20, 900, 5), rng.choice((10, 15, 20, 25, 30, 40)), rng.choice((5, 7, 8, 10, 12))
        first = f"A {item} costs ${price}. It is discounted by {disc}% and then {tax}% sales tax is added. What is the final price?"
        follow = f"Now solve it if the price were ${price + rng.randrange(10, 200, 5)}."
    elif kind == 1:
        d, t, d2 = rng.randrange(60, 600, 10), rng.randint(2, 8), rng.randrange(100, 900, 10)
        first = f"A train covers {d} km in {t} hours at a steady speed. How long does it take to cover {d2} km? Give hours and minutes."
        follow = f"What if the train stops for {rng.choice((10, 15, 20, 30))} minutes halfway through the longer journey?"
    elif kind == 2:
        a, b, who = rng.randint(2, 12), rng.randint(3, 15), rng.sample(NAMES, 2)
        first = f"{who[0]} can paint a fence alone in {a} hours, and {who[1]} can paint it alone in {b} hours. How long does it take them working together?"
        follow = f"Now solve it if {who[1]} needed {b + rng.randint(1, 6)} hours alone."
    elif kind == 3:
        w, l = rng.randint(3, 40), rng.randint(3, 40)
        shape = rng.choice((f"a rectangular garden {w} m by {l} m surrounded by a path 1 m wide",
                            f"a circular pond with a radius of {w} m", f"a right triangle with legs of {w} cm and {l} cm"))
        first = f"Find the area and the perimeter of {shape}."
        follow = f"Now solve it if the first measurement were {w + rng.randint(1, 10)} instead."
    elif kind == 4:
        r, g, k = rng.randint(2, 12), rng.randint(2, 12), rng.choice((2, 3))
        first = f"A bag holds {r} red and {g} green marbles. You draw {k} marbles without replacement. What is the probability that all of them are red?"
        follow = "How does the answer change if each marble is put back before the next draw?"
    elif kind == 5:
        a, d, n = rng.randint(-10, 20), rng.randint(2, 9), rng.randint(15, 80)
        if rng.random() < 0.5:
            seq = ", ".join(str(a + i * d) for i in range(4))
            first = f"The sequence {seq}, ... continues in the same way. What is its {n}th term, and what is the sum of the first {n} terms?"
        else:
            a, r = rng.randint(1, 6), rng.choice((2, 3))
            seq = ", ".join(str(a * r ** i) for i in range(4))
            first = f"Find the rule behind {seq}, ... and the {n % 12 + 6}th term."
        follow = "Now find a formula for the general term and prove it by induction."
    elif kind == 6:
        a, x, b = rng.randint(2, 12), rng.randint(-10, 20), rng.randint(1, 40)
        c = a * x + b
        first = f"Solve for x: {a}x + {b} = {c}. Show each step."
        follow = f"Now solve {a}x + {b} = {c + a * rng.randint(1, 9)} and check your answer by substitution."
    elif kind == 7:
        x, y = rng.randint(-6, 9), rng.randint(-6, 9)
        a, b, d, e = rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 7)
        first = f"Solve the system of equations: {a}x + {b}y = {a * x + b * y} and {d}x - {e}y = {d * x - e * y}."
        follow = "Solve it again by a different method and show that both methods agree."
    elif kind == 8:
        p, r, t = rng.randrange(500, 20000, 100), rng.choice((2, 3, 4, 5, 6)), rng.randint(2, 15)
        first = f"You invest ${p} at {r}% interest per year, compounded annually. How much will you have after {t} years, and how much of that is interest?"
        follow = f"Now solve it if the rate were {r + 1}% and interest were compounded monthly."
    else:
        r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
        b, c = -(r1 + r2), r1 * r2
        poly = "x^2" + (f" {'+' if b >= 0 else '-'} {abs(b)}x" if b else "") + (f" {'+' if c >= 0 else '-'} {abs(c)}" if c else "")
        first = f"Solve the quadratic equation {poly} = 0 by factoring, and check your roots."
        follow = "Now solve it with the quadratic formula and explain what the discriminant tells you."
    return first, (follow if rng.random() < 0.6 else rng.choice(MATH_FOLLOWUPS))


def _snippet(rng: random.Random) -> tuple[str, str]:
    """A short generated code snippet and what to ask about it ('fix' or 'explain')."""
    f, v = rng.choice(("total", "compute", "process", "summarize", "helper")), rng.choice(("items", "values", "nums", "data"))
    k = rng.randint(2, 9)
    snippets = (
        ("fix", f"def {f}({v}):\n    s = 0\n    for i in range(1, len({v})):\n        s += {v}[i]\n    return s"),
        ("fix", f"def {f}({v}):\n    best = 0\n    for x in {v}:\n        if x > best:\n            best = x\n    return best"),
        ("fix", f"def {f}(text):\n    counts = {{}}\n    for w in text.split():\n        counts[w] += 1\n    return counts"),
        ("fix", f"function {f}({v}) {{\n  let out = [];\n  for (let i = 0; i <= {v}.length; i++) {{\n    out.push({v}[i] * {k});\n  }}\n  return out;\n}}"),
        ("fix", f"def remember(x, seen=[]):\n    seen.append(x * {k})\n    return seen\n\nprint(remember(1))\nprint(remember(2))  # expected [{2 * k}]"),
        ("explain", f"result = [x * {k} for x in {v} if x % {k} == 0]"),
        ("explain", f"def {f}(n):\n    return 1 if n <= 1 else n * {f}(n - 1)"),
        ("explain", f"const {f} = {v}.reduce((acc, x) => acc + (x > {k} ? 1 : 0), 0);"),
        ("explain", f"SELECT city, COUNT(*) AS n\nFROM customers\nGROUP BY city\nHAVING COUNT(*) > {k}\nORDER BY n DESC;"),
        ("explain", f"find . -name '*.log' -mtime +{k} -exec gzip {{}} \\;"),
    )
    return rng.choice(snippets)


def _coding(rng: random.Random, passages: list[str]) -> Pair:
    r = rng.random()
    if r < 0.2:
        ask, code = _snippet(rng)
        if ask == "fix":
            first = rng.choice(("This code has a bug. Find it and fix it:", "Why doesn't this work as intended? Please fix it:",
                                "Can you spot the mistake in this snippet and correct it?")) + f"\n\n{code}"
        else:
            first = rng.choice(("Explain what this code does, line by line:", "What does the following snippet do, and when would you use it?")) + f"\n\n{code}"
        return first, rng.choice(("Now add error handling and tests.", "Rewrite it in a more readable way.", "What would change for very large inputs?"))
    if r < 0.3:
        lang, task = "SQL", rng.choice(SQL_TASKS)
        first = rng.choice(("Write an SQL query{d} that {task}. Describe the tables you assume.", "Write a SQL query{d} that {task}.")).format(
            task=task, d=rng.choice(SQL_DIALECTS)) + rng.choice(CODE_SUFFIXES[:4])
        return first, rng.choice(("Now add an index that would speed it up and explain why.", "Explain the query to someone new to SQL."))
    if r < 0.35:
        first = rng.choice(("Write a Bash script that {task}.", "Write a shell script that {task}, with comments.")).format(
            task=rng.choice(BASH_TASKS)) + rng.choice(CODE_SUFFIXES[:4])
        return first, rng.choice(("Now add error handling and a dry-run option.", "Make it work on macOS as well as Linux."))
    lang = rng.choice(LANGUAGES)
    first = rng.choice(CODING).format(lang=lang, task=rng.choice(CODING_TASKS)) + rng.choice(CODE_SUFFIXES)
    other = rng.choice([x for x in LANGUAGES if x != lang])
    return first, rng.choice(CODING_FOLLOWUPS).format(other=other)


def _cut(rng: random.Random, passage: str, max_words: int = 120) -> str:
    """A random run of whole sentences from `passage`, at most `max_words` words (cut on a word boundary
    when a single sentence is longer)."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+", " ".join(passage.split())) if s]
    if not sentences:
        return ""
    start = rng.randrange(len(sentences)) if len(" ".join(sentences).split()) > max_words else 0
    out: list[str] = []
    for s in sentences[start:]:
        if out and len(" ".join(out + [s]).split()) > max_words:
            break
        out.append(s)
    words = " ".join(out).split()
    return " ".join(words[:max_words])


def _extraction(rng: random.Random, passages: list[str]) -> Pair:
    passage = _cut(rng, rng.choice(passages))
    first = rng.choice(EXTRACTION).format(passage=passage, k=rng.randint(3, 5))
    return first, _followup(rng, EXTRACTION_FOLLOWUPS, 0.3)


GENERATORS: dict[str, Callable[[random.Random, list[str]], Pair]] = {
    "writing": _writing, "roleplay": _roleplay, "stem": _stem, "humanities": _humanities,
    "reasoning": _reasoning, "math": _math, "coding": _coding, "extraction": _extraction,
}


def capacity(passages: list[str]) -> int:
    """A generous upper bound on the distinct first turns the tables can form (numeric families are
    bounded by their parameter ranges, rounded up). Asking for more than this is certainly impossible."""
    n_sent = sum(max(1, len(re.split(r"(?<=[.!?])\s+", p))) for p in passages if p.strip())
    return (len(WRITING) * len(TOPICS) * len(LIMITS) + len(ROLE_OPENERS) * len(PERSONAS) * len(ROLE_TASKS) * len(TOPICS) * len(ROLE_SUFFIXES)
            + len(STEM) * (len(STEM_TOPICS) * len(AUDIENCES) + len(PAIRS)) * len(STEM_SUFFIXES)
            + len(HUMANITIES) * (len(HUMANITIES_TOPICS) * 4 + len(DEBATES)) * len(HUMANITIES_SUFFIXES)
            + 10 ** 7 + 10 ** 7  # reasoning, math: products of their random ranges, rounded up
            + (len(CODING) * len(LANGUAGES) * len(CODING_TASKS) + 2 * len(SQL_DIALECTS) * len(SQL_TASKS) + 2 * len(BASH_TASKS))
            * len(CODE_SUFFIXES) + 10 ** 5  # last term: generated snippets
            + len(EXTRACTION) * 3 * n_sent)


def synthetic_conversations_with_families(n: int, seed: int, passages: list[str]) -> list[tuple[str, list[dict[str, str]]]]:
    """Like `synthetic_conversations`, with each conversation's family name (one of FAMILIES) beside it."""
    passages = [p for p in passages if p.strip()]
    families = [f for f in FAMILIES if f != "extraction" or passages]
    if n > capacity(passages):
        raise ValueError(f"n={n} exceeds the {capacity(passages)} distinct first turns the prompt tables can form")
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[tuple[str, list[dict[str, str]]]] = []
    misses = 0  # consecutive: one exhausted family just hands its share to the others
    while len(out) < n:
        family = rng.choice(families)
        first, follow = GENERATORS[family](rng, passages)
        if first in seen:  # redraw duplicates; a long run of them means the tables are exhausted
            misses += 1
            if misses > 10_000:
                raise ValueError(f"only {len(out)} distinct first turns found for n={n}: the prompt tables are exhausted")
            continue
        seen.add(first)
        misses = 0
        out.append((family, [{"role": "user", "content": first}, {"role": "assistant", "content": "."},
                             {"role": "user", "content": follow}, {"role": "assistant", "content": "."}]))
    return out


def synthetic_conversations(n: int, seed: int, passages: list[str]) -> list[list[dict[str, str]]]:
    """n conversations, each [user, assistant ".", user, assistant "."]: the "." answers are placeholders the
    target model regenerates. Deterministic given `seed`; first user turns are unique within a call.
    Extraction prompts quote a cut of a random entry of `passages`; with no passages that family is skipped.
    Raises ValueError when n exceeds what the tables can give without duplicates."""
    return [conv for _, conv in synthetic_conversations_with_families(n, seed, passages)]


# ========================================================================================= contamination
def _words(text: str) -> list[str]:
    """Lowercased words with punctuation stripped (apostrophes dropped, other marks split words)."""
    return re.findall(r"[a-z0-9]+", text.lower().replace("'", "").replace("\u2019", ""))


def ngram_set(texts: list[str], n: int = 8) -> frozenset[tuple[str, ...]]:
    """Every n-word sequence of `texts`; build it once and pass it to `contaminated` for many prompts."""
    return frozenset(tuple(w[i:i + n]) for t in texts for w in [_words(t)] for i in range(len(w) - n + 1))


def contaminated(prompt: str, references: list[str] | frozenset[tuple[str, ...]], n: int = 8) -> bool:
    """True if prompt shares any n-word sequence (lowercased, punctuation stripped) with a reference.

    `references` is either the reference texts or, for many prompts, `ngram_set(texts, n)` built once."""
    grams = references if isinstance(references, frozenset) else ngram_set(references, n)
    w = _words(prompt)
    return any(tuple(w[i:i + n]) in grams for i in range(len(w) - n + 1))


# ========================================================================================= command line
def passage_ok(text: str) -> bool:
    """An answer fit to serve as an extraction passage: plain English prose of 60+ words, no code."""
    return len(text.split()) >= 60 and "```" not in text and text.isascii()


def clean_conversations(n: int, seed: int, passages: list[str], references: list[str]) -> list[list[dict[str, str]]]:
    """`synthetic_conversations` without any whose user turns share eight words in a row with a
    reference text (the benchmark's questions), so that the benchmark stays unseen."""
    grams = ngram_set(references)
    made = synthetic_conversations(n, seed, passages)
    return [c for c in made if not any(contaminated(m["content"], grams) for m in c if m["role"] == "user")]

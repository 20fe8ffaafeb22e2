"""The service domains: templates of an entity with a key and typed attributes, from which ``services.py`` draws
records, tools and tasks.

Each ``Domain`` names its entity and how prompts refer to one record, the key parameter and the pools its keys are
made from, two enum and two integer attributes (the enum searches filter on, the integer that is its price), what a
quote's quantity counts, and its three tools' names. Twenty-eight are seen in train and validation (their records
split between the splits); two (``UNSEEN_DOMAINS``) appear only in test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Attribute:
    name: str  # the field in tool results and schemas, e.g. "fare"
    phrase: str  # how a prompt names it, e.g. "fare"
    kind: Literal["integer", "enum"]
    choices: tuple[str, ...] = ()  # an enum's values
    low: int = 0  # an integer's range
    high: int = 0


@dataclass(frozen=True)
class Domain:
    name: str
    entity: str  # "flight"
    plural: str  # "flights"
    ref: str  # how a prompt names one record: "flight {key}"
    key: str  # the key parameter: "flight_number"
    key_phrase: str  # "flight number"
    prefixes: tuple[str, ...]  # keys are prefix + suffix pairs
    suffixes: tuple[str, ...]
    attributes: tuple[Attribute, ...]
    category: str  # the enum attribute searches filter on
    price: str  # the integer attribute quotes multiply and searches bound and sort by
    unit: str  # what a quote's quantity counts: "seats"
    tools: tuple[str, str, str]  # the look-up, search and quote tools' names
    what: str  # what the service is, for descriptions: "the airline's flight schedule"
    size: int = 18
    joiner: str = " "

    def attribute(self, name: str) -> Attribute:
        return next(a for a in self.attributes if a.name == name)

    def ref_of(self, key: str) -> str:
        return self.ref.format(key=key)


def _int(name: str, phrase: str, low: int, high: int) -> Attribute:
    return Attribute(name, phrase, "integer", low=low, high=high)


def _enum(name: str, phrase: str, *choices: str) -> Attribute:
    return Attribute(name, phrase, "enum", choices=choices)


DOMAINS: tuple[Domain, ...] = (
    Domain("flights", "flight", "flights", "flight {key}", "flight_number", "flight number",
           ("AZ", "KL", "LX", "OS", "SK", "TP"), ("214", "388", "452", "617", "730", "845"),
           (_enum("status", "status", "on time", "delayed", "cancelled", "boarding"),
            _enum("terminal", "terminal", "north", "south", "central"),
            _int("fare", "fare", 60, 480), _int("seats_left", "number of free seats", 0, 90)),
           "status", "fare", "seats", ("get_flight", "search_flights", "quote_fare"),
           "the airline's flight schedule", joiner=""),
    Domain("books", "book", "books", "the book {key}", "title", "title",
           ("Winter", "Silent", "Hidden", "Golden", "Broken", "Distant"),
           ("Harbor", "Orchard", "Lantern", "Compass", "Meadow", "Archive"),
           (_enum("genre", "genre", "mystery", "history", "poetry", "science"),
            _enum("shelf", "shelf", "upper", "middle", "lower"),
            _int("weekly_rent", "weekly rental price", 2, 40), _int("copies", "number of copies", 1, 12)),
           "genre", "weekly_rent", "weeks", ("find_book", "search_catalog", "quote_rental"),
           "the library catalogue"),
    Domain("hotels", "hotel", "hotels", "the {key} hotel", "hotel", "hotel name",
           ("Aurora", "Cedar", "Harbour", "Linden", "Maple", "Summit"),
           ("Lodge", "Court", "House", "Palace", "Inn", "Suites"),
           (_enum("board", "board", "breakfast", "half board", "full board", "room only"),
            _enum("district", "district", "old town", "riverside", "station"),
            _int("nightly_rate", "nightly rate", 45, 390), _int("stars", "star rating", 1, 5)),
           "board", "nightly_rate", "nights", ("get_hotel", "search_hotels", "quote_stay"),
           "the hotel booking service"),
    Domain("cars", "rental car", "rental cars", "the rental car {key}", "plate", "plate number",
           ("RC", "RT", "RV", "RW", "RX", "RY"), ("1042", "2317", "3580", "4621", "5903", "6174"),
           (_enum("category", "category", "economy", "compact", "estate", "minivan"),
            _enum("gearbox", "gearbox", "manual", "automatic"),
            _int("daily_rate", "daily rate", 18, 140), _int("doors", "number of doors", 2, 5)),
           "category", "daily_rate", "days", ("get_car", "search_cars", "quote_rental_car"),
           "the car rental fleet", joiner="-"),
    Domain("dishes", "dish", "dishes", "the dish {key}", "dish", "dish name",
           ("smoked", "spiced", "grilled", "roasted", "braised", "glazed"),
           ("trout", "lentils", "aubergine", "lamb", "tofu", "risotto"),
           (_enum("cuisine", "cuisine", "nordic", "levantine", "andean", "bengali"),
            _enum("course", "course", "starter", "main", "dessert"),
            _int("price", "menu price", 6, 58), _int("calories", "calorie count", 180, 1200)),
           "cuisine", "price", "portions", ("get_dish", "search_menu", "quote_order"),
           "the restaurant's menu"),
    Domain("parcels", "parcel", "parcels", "parcel {key}", "tracking_id", "tracking id",
           ("PK", "PL", "PM", "PN", "PQ", "PR"), ("4821", "5370", "6194", "7038", "8265", "9412"),
           (_enum("state", "delivery state", "in transit", "delivered", "held at customs", "out for delivery"),
            _enum("service", "shipping service", "standard", "priority", "freight"),
            _int("fee", "shipping fee", 4, 96), _int("weight_kg", "weight in kilograms", 1, 40)),
           "state", "fee", "parcels", ("track_parcel", "search_parcels", "quote_shipping"),
           "the courier's tracking system", joiner="-"),
    Domain("gyms", "gym", "gyms", "the {key} gym", "gym", "gym name",
           ("Iron", "Pulse", "Vigor", "Apex", "Forge", "Kinetic"),
           ("Works", "Athletics", "Strength", "Motion", "Studio", "Fitness"),
           (_enum("focus", "class focus", "yoga", "spinning", "boxing", "pilates"),
            _enum("plan", "membership plan", "off-peak", "all hours", "premium"),
            _int("monthly_fee", "monthly fee", 15, 95), _int("trainers", "number of trainers", 1, 20)),
           "focus", "monthly_fee", "months", ("get_gym", "search_gyms", "quote_membership"),
           "the gym chain's club directory"),
    Domain("plants", "plant", "plants", "the plant {key}", "plant", "plant name",
           ("Dwarf", "Weeping", "Creeping", "Giant", "Variegated", "Trailing"),
           ("fern", "ivy", "palm", "fig", "begonia", "jasmine"),
           (_enum("light", "light need", "full sun", "partial shade", "deep shade"),
            _enum("pot", "pot type", "clay", "plastic", "ceramic"),
            _int("pot_price", "price per pot", 4, 75), _int("height_cm", "height in centimetres", 10, 180)),
           "light", "pot_price", "pots", ("get_plant", "search_plants", "quote_plants"),
           "the garden centre's stock list"),
    Domain("museums", "museum", "museums", "the {key} museum", "museum", "museum name",
           ("Northgate", "Eastwick", "Westmoor", "Southbay", "Kingsbridge", "Queensway"),
           ("Hall", "Manor", "Abbey", "Mill", "Arcade", "Foundry"),
           (_enum("theme", "theme", "art", "science", "local history", "design"),
            _enum("audio_guide", "audio guide", "included", "extra charge", "not offered"),
            _int("admission", "admission price", 4, 45), _int("rooms", "number of rooms", 3, 60)),
           "theme", "admission", "tickets", ("get_museum", "search_museums", "quote_admission"),
           "the city's museum guide"),
    Domain("bikes", "bike", "bikes", "bike {key}", "bike_id", "bike number",
           ("BK", "BX", "BZ", "BV", "BW", "BQ"), ("108", "226", "341", "459", "572", "693"),
           (_enum("type", "bike type", "city", "mountain", "electric", "cargo"),
            _enum("frame", "frame size", "small", "medium", "large"),
            _int("hourly_rate", "hourly rate", 3, 45), _int("gears", "number of gears", 1, 24)),
           "type", "hourly_rate", "hours", ("get_bike", "search_bikes", "quote_bike_hire"),
           "the bike hire scheme", joiner="-"),
    Domain("courses", "course", "courses", "the course {key}", "course_code", "course code",
           ("GEO", "BIO", "CHEM", "ECON", "LIT", "MATH"), ("101", "205", "312", "340", "418", "520"),
           (_enum("level", "level", "beginner", "intermediate", "advanced"),
            _enum("format", "format", "online", "in person", "blended"),
            _int("tuition", "tuition fee", 90, 480), _int("credits", "number of credits", 1, 10)),
           "level", "tuition", "seats", ("get_course", "search_courses", "quote_enrolment"),
           "the college's course catalogue", joiner=""),
    Domain("apartments", "apartment", "apartments", "the {key} apartment", "apartment", "apartment name",
           ("Birch", "Willow", "Alder", "Rowan", "Hazel", "Poplar"),
           ("Heights", "Mews", "Lofts", "Yard", "Quarters", "Towers"),
           (_enum("heating", "heating", "gas", "electric", "heat pump"),
            _enum("floor", "floor level", "ground", "middle", "top"),
            _int("monthly_rent", "monthly rent", 450, 1900), _int("bedrooms", "number of bedrooms", 1, 4)),
           "heating", "monthly_rent", "months", ("get_apartment", "search_apartments", "quote_lease"),
           "the letting agency's listings"),
    Domain("pets", "pet", "pets", "the pet {key}", "pet_name", "pet's name",
           ("Little", "Fluffy", "Lucky", "Sunny", "Mister", "Captain"),
           ("Biscuit", "Pepper", "Noodle", "Pickle", "Waffle", "Muffin"),
           (_enum("species", "species", "cat", "dog", "rabbit", "parrot"),
            _enum("temperament", "temperament", "calm", "playful", "shy"),
            _int("boarding_rate", "daily boarding rate", 12, 70), _int("age_months", "age in months", 2, 160)),
           "species", "boarding_rate", "days", ("get_pet", "search_pets", "quote_pet_boarding"),
           "the pet hotel's guest register"),
    Domain("wines", "wine", "wines", "the wine {key}", "wine", "wine name",
           ("Chateau", "Domaine", "Villa", "Castello", "Bodega", "Quinta"),
           ("Rosso", "Blanc", "Reserva", "Noir", "Classico", "Cuvee"),
           (_enum("colour", "colour", "red", "white", "rose", "sparkling"),
            _enum("body", "body", "light", "medium", "full"),
            _int("bottle_price", "bottle price", 7, 95), _int("age_years", "age in years", 1, 25)),
           "colour", "bottle_price", "bottles", ("get_wine", "search_wines", "quote_wine_order"),
           "the wine merchant's cellar list"),
    Domain("games", "game", "games", "the game {key}", "game", "game title",
           ("Star", "Shadow", "Dragon", "Pixel", "Thunder", "Crystal"),
           ("Quest", "Legends", "Raiders", "Odyssey", "Tactics", "Frontier"),
           (_enum("platform", "platform", "console", "pc", "handheld"),
            _enum("rating", "age rating", "everyone", "teen", "mature"),
            _int("price", "store price", 5, 70), _int("players", "maximum number of players", 1, 8)),
           "platform", "price", "copies", ("get_game", "search_games", "quote_game_order"),
           "the game shop's catalogue"),
    Domain("laptops", "laptop", "laptops", "the {key} laptop", "model", "model name",
           ("Nova", "Orion", "Zenith", "Vega", "Lyra", "Atlas"), ("Air", "Pro", "Flex", "Edge", "Book", "Slim"),
           (_enum("processor", "processor", "dual-core", "quad-core", "octa-core"),
            _enum("finish", "finish", "silver", "graphite", "white"),
            _int("retail_price", "retail price", 280, 1600), _int("battery_hours", "battery life in hours", 4, 20)),
           "processor", "retail_price", "units", ("get_laptop", "search_laptops", "quote_laptops"),
           "the computer shop's inventory"),
    Domain("tours", "tour", "tours", "the {key} tour", "tour", "tour name",
           ("Coastal", "Canyon", "Vineyard", "Glacier", "Highland", "Lakeside"),
           ("Explorer", "Discovery", "Trail", "Escape", "Voyage", "Ramble"),
           (_enum("transport", "transport", "coach", "walking", "boat", "cycling"),
            _enum("difficulty", "difficulty", "easy", "moderate", "hard"),
            _int("price", "price per person", 25, 240), _int("duration_hours", "duration in hours", 1, 12)),
           "transport", "price", "places", ("get_tour", "search_tours", "quote_tour"),
           "the tour operator's programme"),
    Domain("ferries", "ferry", "ferries", "ferry {key}", "sailing", "sailing code",
           ("FE", "FJ", "FN", "FR", "FS", "FW"), ("110", "125", "240", "265", "380", "395"),
           (_enum("route", "route", "island", "river", "cross-channel"),
            _enum("catering", "catering", "cafe", "restaurant", "vending machines"),
            _int("crossing_fare", "crossing fare", 8, 90),
            _int("duration_min", "crossing time in minutes", 20, 240)),
           "route", "crossing_fare", "crossings", ("get_sailing", "search_sailings", "quote_crossing"),
           "the ferry operator's timetable", joiner=""),
    Domain("doctors", "doctor", "doctors", "Dr {key}", "doctor", "name",
           ("Okafor", "Lindqvist", "Moreau", "Tanaka", "Varga", "Whitfield"),
           ("Reyes", "Brandt", "Kowal", "Nakamura", "Osei", "Petrov"),
           (_enum("specialty", "specialty", "general practice", "dermatology", "paediatrics", "cardiology"),
            _enum("appointments", "appointment type", "in person", "video", "phone"),
            _int("consultation_fee", "consultation fee", 30, 160),
            _int("experience_years", "experience in years", 2, 35)),
           "specialty", "consultation_fee", "consultations",
           ("get_doctor", "search_doctors", "quote_consultations"), "the clinic's practitioner directory", joiner="-"),
    Domain("paintings", "painting", "paintings", "the painting {key}", "painting", "painting title",
           ("Autumn", "Morning", "Quiet", "Scarlet", "Misty", "Twilight"),
           ("Harvest", "Bridge", "Shoreline", "Window", "Field", "Pier"),
           (_enum("medium", "medium", "oil", "watercolour", "acrylic", "charcoal"),
            _enum("style", "style", "abstract", "landscape", "portrait"),
            _int("print_price", "print price", 12, 90), _int("width_cm", "width in centimetres", 20, 200)),
           "medium", "print_price", "prints", ("get_painting", "search_gallery", "quote_prints"),
           "the gallery's print shop"),
    Domain("boats", "boat", "boats", "the boat {key}", "boat", "boat name",
           ("Swift", "Gull", "Osprey", "Petrel", "Tern", "Heron"),
           ("Spray", "Wake", "Breeze", "Current", "Drift", "Swell"),
           (_enum("type", "boat type", "sailboat", "motorboat", "catamaran"),
            _enum("hull", "hull", "fibreglass", "wooden", "aluminium"),
            _int("daily_charter", "daily charter rate", 90, 520), _int("berths", "number of berths", 2, 10)),
           "type", "daily_charter", "days", ("get_boat", "search_boats", "quote_charter"),
           "the marina's charter fleet"),
    Domain("instruments", "instrument", "instruments", "instrument {key}", "serial", "serial number",
           ("GT", "VL", "FL", "SX", "CL", "KB"), ("310", "425", "560", "675", "790", "815"),
           (_enum("family", "instrument family", "woodwind", "brass", "percussion", "keyboard"),
            _enum("condition", "condition", "new", "used", "refurbished"),
            _int("monthly_hire", "monthly hire fee", 8, 75), _int("age_years", "age in years", 0, 40)),
           "family", "monthly_hire", "months", ("get_instrument", "search_instruments", "quote_instrument_hire"),
           "the music shop's hire stock", joiner="-"),
    Domain("tents", "tent", "tents", "the {key} tent", "tent", "tent model",
           ("Ridge", "Trek", "Alpine", "Basecamp", "Nomad", "Prairie"),
           ("Dome", "Tunnel", "Shelter", "Haven", "Den", "Lite"),
           (_enum("season", "season rating", "summer", "all-season", "winter"),
            _enum("colour", "colour", "green", "orange", "sand"),
            _int("weekly_hire", "weekly hire price", 15, 80), _int("sleeps", "number of sleeping places", 1, 8)),
           "season", "weekly_hire", "weeks", ("get_tent", "search_tents", "quote_tent_hire"),
           "the outdoor shop's hire counter"),
    Domain("bouquets", "bouquet", "bouquets", "the {key} bouquet", "bouquet", "bouquet name",
           ("Blush", "Sunrise", "Petal", "Pastel", "Dewdrop", "Posy"),
           ("Charm", "Delight", "Whisper", "Medley", "Bloom", "Promise"),
           (_enum("flower", "main flower", "roses", "tulips", "lilies", "peonies"),
            _enum("wrap", "wrapping", "paper", "hatbox", "vase"),
            _int("price", "bouquet price", 18, 95), _int("stems", "number of stems", 6, 40)),
           "flower", "price", "bouquets", ("get_bouquet", "search_bouquets", "quote_flowers"),
           "the florist's order book"),
    Domain("vinyls", "vinyl record", "vinyl records", "the record {key}", "album", "album title",
           ("Neon", "Hollow", "Satin", "Midnight", "Wild", "Lunar"),
           ("Hearts", "Radio", "Parade", "Motel", "Rivers", "Signals"),
           (_enum("genre", "genre", "jazz", "soul", "punk", "reggae"),
            _enum("condition", "condition", "mint", "good", "worn"),
            _int("sale_price", "sale price", 8, 64), _int("tracks", "number of tracks", 6, 18)),
           "genre", "sale_price", "copies", ("get_vinyl", "search_vinyls", "quote_vinyls"),
           "the record shop's stock"),
    Domain("sofas", "sofa", "sofas", "the {key} sofa", "sofa", "sofa model",
           ("Nook", "Cove", "Hearth", "Snug", "Bay", "Dune"),
           ("Classic", "Modular", "Deluxe", "Recliner", "Lounger", "Daybed"),
           (_enum("upholstery", "upholstery", "linen", "leather", "wool", "corduroy"),
            _enum("size", "size", "two-seater", "three-seater", "corner unit"),
            _int("showroom_price", "showroom price", 290, 1800),
            _int("delivery_days", "delivery time in days", 2, 45)),
           "upholstery", "showroom_price", "units", ("get_sofa", "search_sofas", "quote_sofas"),
           "the furniture store's showroom"),
    Domain("kayaks", "kayak", "kayaks", "kayak {key}", "kayak_id", "kayak number",
           ("KQ", "KA", "KS", "KT", "KU", "KW"), ("118", "236", "354", "472", "581", "699"),
           (_enum("type", "kayak type", "sit-on-top", "touring", "whitewater", "inflatable"),
            _enum("seating", "seating", "single", "tandem"),
            _int("hourly_hire", "hourly hire price", 5, 48), _int("length_cm", "length in centimetres", 240, 520)),
           "type", "hourly_hire", "hours", ("get_kayak", "search_kayaks", "quote_kayak_hire"),
           "the paddle centre's hire fleet", joiner="-"),
    Domain("cabins", "cabin", "cabins", "the {key} cabin", "cabin", "cabin name",
           ("Pine", "Bracken", "Stone", "Moss", "Elk", "Fox"),
           ("Retreat", "Hideaway", "Lookout", "Nest", "Burrow", "Chalet"),
           (_enum("setting", "setting", "forest", "mountain", "riverbank", "coast"),
            _enum("access", "access", "paved road", "gravel track", "footpath"),
            _int("nightly_price", "nightly price", 55, 260), _int("guests", "guest capacity", 2, 10)),
           "setting", "nightly_price", "nights", ("get_cabin", "search_cabins", "quote_cabin_stay"),
           "the holiday cabin booking site"),
    # Test only: no train or validation task offers these tools.
    Domain("concerts", "concert", "concerts", "the {key} concert", "concert", "concert name",
           ("Velvet", "Copper", "Crimson", "Ivory", "Cobalt", "Amber"),
           ("Echoes", "Tides", "Skyline", "Rhythms", "Voices", "Strings"),
           (_enum("venue", "venue", "arena", "opera house", "open-air stage", "jazz club"),
            _enum("genre", "genre", "rock", "classical", "folk", "electronic"),
            _int("ticket_price", "ticket price", 15, 220), _int("tickets_left", "number of tickets left", 0, 500)),
           "venue", "ticket_price", "tickets", ("get_concert", "search_concerts", "quote_tickets"),
           "the concert box office"),
    Domain("medicines", "medicine", "medicines", "the medicine {key}", "medicine", "medicine name",
           ("Nexo", "Calvi", "Dorma", "Lumi", "Pira", "Tolva"),
           ("dine", "prazole", "cillin", "statin", "mab", "sartan"),
           (_enum("form", "form", "tablet", "capsule", "syrup", "cream"),
            _enum("prescription", "prescription status", "prescription only", "over the counter"),
            _int("pack_price", "pack price", 3, 85), _int("stock", "packs in stock", 0, 300)),
           "form", "pack_price", "packs", ("get_medicine", "search_pharmacy", "quote_medicine"),
           "the pharmacy's stock system", joiner=""),
)
UNSEEN_DOMAINS = ("concerts", "medicines")
SEEN_DOMAINS = tuple(d.name for d in DOMAINS if d.name not in UNSEEN_DOMAINS)
BY_NAME = {d.name: d for d in DOMAINS}  # each domain by its name

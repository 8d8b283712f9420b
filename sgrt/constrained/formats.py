"""Regexes for the JSON Schema ``format`` values we enforce.

llguidance enforces all of :data:`KNOWN_FORMATS` natively, but its ``date`` accepts Feb 29 of
any year, its ``time`` / ``date-time`` a leap second at any minute, and its ``hostname`` names
longer than 253 characters and malformed IDNA labels (``xn--X``), so for those four
(:data:`LLGUIDANCE_OVERRIDES`) we give it the regexes below instead. outlines-core knows only
some formats (its date-time accepts a missing offset, its uuid is lowercase only), so for that
backend every known format is replaced by the regex below before compiling. Each regex matches the *decoded*
string, in full, uses no character that needs escaping inside a JSON string, and accepts a
subset of what RFC 3339 / 5321 / 1123 / 3986 / 4122 / 4291 allow (never more): a conservative
subset keeps "never accept an invalid value" true at the price of a few rare valid forms
(leap seconds, IPv6 with an embedded IPv4 tail, URIs with user info or IP-literal hosts,
hostnames longer than four labels).
"""
from __future__ import annotations

KNOWN_FORMATS = ("date-time", "date", "time", "email", "uuid", "ipv4", "ipv6", "uri", "hostname")
# Formats whose llguidance implementation accepts invalid values (JSON Schema Test Suite,
# optional/format): replaced by our regex for that backend too.
LLGUIDANCE_OVERRIDES = ("date-time", "date", "time", "hostname")

_D31 = r"(?:0[1-9]|[12][0-9]|3[01])"
_D30 = r"(?:0[1-9]|[12][0-9]|30)"
_D28 = r"(?:0[1-9]|1[0-9]|2[0-8])"
_YEAR = r"[0-9]{4}"
# Leap years: divisible by 4 and not by 100, or divisible by 400.
_LEAP_YEAR = (
    r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:[02468][048]|[13579][26])00)"
)
DATE = (
    rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-{_D31}|(?:0[469]|11)-{_D30}|02-{_D28})"
    rf"|{_LEAP_YEAR}-02-29)"
)
_OFFSET = r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
TIME = rf"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{{1,9}})?{_OFFSET}"
DATE_TIME = rf"{DATE}T{TIME}"
_A = "[A-Za-z0-9]"
_AD = "[A-Za-z0-9-]"
# An LDH label of 1..61 characters that does not have "--" in positions 3-4 (reserved for
# IDNA A-labels, whose punycode a regex cannot check; RFC 5891 4.2.3.1).
_LABEL = rf"(?:{_A}(?:{_AD}?{_A})?|{_A}{_AD}{_AD}{_A}|{_A}{_AD}(?:{_A}{_AD}|-{_A}){_AD}{{0,56}}{_A})"
# At most four labels of at most 61 characters: always within the 253-character limit.
HOSTNAME = rf"{_LABEL}(?:\.{_LABEL}){{0,3}}"
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
EMAIL = rf"{_ATEXT}{{1,64}}(?:\.{_ATEXT}{{1,64}}){{0,7}}@{HOSTNAME}"
_H = r"[0-9a-fA-F]"
UUID = rf"{_H}{{8}}-{_H}{{4}}-{_H}{{4}}-{_H}{{4}}-{_H}{{12}}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = rf"{_H}{{1,4}}"
IPV6 = (
    "(?:"
    rf"(?:{_H16}:){{7}}{_H16}"
    rf"|::(?:{_H16}:){{0,5}}{_H16}"
    rf"|{_H16}::(?:{_H16}:){{0,4}}{_H16}"
    rf"|(?:{_H16}:){{0,1}}{_H16}::(?:{_H16}:){{0,3}}{_H16}"
    rf"|(?:{_H16}:){{0,2}}{_H16}::(?:{_H16}:){{0,2}}{_H16}"
    rf"|(?:{_H16}:){{0,3}}{_H16}::(?:{_H16}:){{0,1}}{_H16}"
    rf"|(?:{_H16}:){{0,4}}{_H16}::{_H16}"
    rf"|(?:{_H16}:){{0,5}}{_H16}::"
    r"|::"
    ")"
)
_PCT = rf"%{_H}{_H}"
_UNRESERVED_SUB = r"[A-Za-z0-9._~!$&'()*+,;=-]"
_PCHAR = rf"(?:{_UNRESERVED_SUB}|[:@]|{_PCT})"
_REG_NAME = rf"(?:{_UNRESERVED_SUB}|{_PCT})*"
URI = (
    r"[A-Za-z][A-Za-z0-9+.-]*:"
    rf"(?://{_REG_NAME}(?::[0-9]{{1,5}})?(?:/{_PCHAR}*)*|/?(?:{_PCHAR}+(?:/{_PCHAR}*)*)?)"
    rf"(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
)

FORMAT_REGEXES: dict[str, str] = {
    "date-time": DATE_TIME,
    "date": DATE,
    "time": TIME,
    "email": EMAIL,
    "uuid": UUID,
    "ipv4": IPV4,
    "ipv6": IPV6,
    "uri": URI,
    "hostname": HOSTNAME,
}

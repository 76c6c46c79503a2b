"""Formats as regexes that accept only valid values (what jsonschema's FormatChecker accepts).

Where an engine's own regex for a format is looser than the format (xgrammar's date allows
2023-02-31, outlines-core's email a raw `"`), the schema gets one of these as its pattern
instead. Each is exact or a narrowing (a subset of the valid values that loses nothing a
model would write): hostnames have at most 4 labels, e-mail addresses and URIs are ASCII.
All are ASCII and free of `"`, `\\` and control characters, so they are also valid as raw
JSON string text (outlines-core), and use only syntax both engines read.
tests/structured_output/test_formats.py checks every one against the FormatChecker.
"""

from __future__ import annotations

_D = "[0-9]"
_YEAR = f"(?:{_D}{{3}}[1-9]|{_D}{{2}}[1-9]{_D}|{_D}[1-9]{_D}{{2}}|[1-9]{_D}{{3}})"  # not 0000
_LEAP_YEAR = f"(?:{_D}{{2}}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = (
    "(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
    "|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
    "|02-(?:0[1-9]|1[0-9]|2[0-8]))"
)
DATE = f"(?:{_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
# RFC 3339 full-time, as rfc3339-validator reads it: an offset is required, no leap second.
_HOUR = "(?:[01][0-9]|2[0-3])"
TIME = f"{_HOUR}:[0-5][0-9]:[0-5][0-9](?:[.][0-9]+)?(?:Z|[+-]{_HOUR}:[0-5][0-9])"
DATE_TIME = f"{DATE}T{TIME}"
_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9][0-9]|[0-9])"  # no leading zeros
IPV4 = f"{_OCTET}(?:[.]{_OCTET}){{3}}"
# RFC 1035 labels of at most 62 characters (4 of them and their dots stay under 253).
_LABEL = "[A-Za-z0-9](?:[A-Za-z0-9-]{0,60}[A-Za-z0-9])?"
HOSTNAME = f"{_LABEL}(?:[.]{_LABEL}){{0,3}}"
_HEX = "[0-9A-Fa-f]"
UUID = f"{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}"
EMAIL = "[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:[.][A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?){0,3}"

# RFC 3986 URIs with a scheme, a host name and a path, query and fragment of unreserved and
# sub-delimiter characters (no percent-encoding, no IP literals): a narrowing.
_PCHAR = "[A-Za-z0-9._~!$&'()*+,;=:@-]"
_QUERY = f"(?:[?](?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_TAIL = f"(?:/{_PCHAR}*)*{_QUERY}"
URI = f"[A-Za-z][A-Za-z0-9+.-]*://{_LABEL}(?:[.]{_LABEL}){{0,3}}(?::[0-9]{{1,5}})?{_TAIL}"
# a URI, or a relative reference: a path whose first segment has no colon, or starts
# with one "/"
URI_REFERENCE = (
    f"(?:{URI}|[A-Za-z0-9._~!$&'()*+,;=@-]+{_TAIL}|/(?:{_PCHAR}+(?:/{_PCHAR}*)*)?{_QUERY})"
)

FORMAT_PATTERNS = {
    "uri": URI,
    "uri-reference": URI_REFERENCE,
    "date": DATE,
    "time": TIME,
    "date-time": DATE_TIME,
    "ipv4": IPV4,
    "hostname": HOSTNAME,
    "uuid": UUID,
    "email": EMAIL,
}

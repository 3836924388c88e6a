# Types of the native module built from csrc/wire.c; keep the two in step.

from array import array

def packed_uint32(field_number: int, values: list[int] | array[int], outer_field: int = 0, /) -> bytes:
    """`values` (ints in [0, 2**32), or an array('I')) as the packed repeated uint32 field `field_number`: its tag,
    its length and the varints (nothing for no values), ready for a message's MergeFromString. With `outer_field`,
    that field wrapped as the only field of the submessage field `outer_field` (present even with no values), ready
    to append to the outer message's bytes. TypeError for an item that is not an int (a bool included), or for
    values of another type; OverflowError for an item out of range; either names the item's index."""

def json_opens(data: bytes, /) -> int:
    """How many '[' and '{' bytes `data` holds: the brackets a JSON text opens, at most (those inside strings
    count too). A text that opens n cannot nest deeper than n. TypeError for anything but bytes."""

def json_take_token_ids(data: bytes, key: str, /) -> tuple[array[int], bytes] | None:
    """The token ids of the field `key` of the JSON object `data`, taken out: the ids as an array('I'), and `data`
    with that field's value written as []. Only where the value is a non-empty array of integer literals in
    [0, 2**32) with JSON's syntax (no sign, fraction, exponent or leading zero), the object has that key once and
    no key written with an escape, and its structure can be followed (brackets, strings, commas). The rest is not
    checked: a JSON decoder reads it. None for anything else. TypeError for data that is not bytes or a key that is
    not a str."""

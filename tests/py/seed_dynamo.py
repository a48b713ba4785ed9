"""Write records as Mozilla's Python autopush lays them out (the seeds'
router and message table schema), with boto3 and none of our code, so a
test can check that the Rust DynamoDB backend reads a migrated table.

usage: seed_dynamo.py ROUTER_TABLE MESSAGE_TABLE UAID_HEX CHID_A CHID_B
Prints a JSON object describing what it wrote. The endpoint, region and
credentials come from the standard AWS environment variables.
"""
import json
import os
import sys
import time

import boto3


def main():
    router_name, message_name, uaid, chid_a, chid_b = sys.argv[1:6]
    db = boto3.resource(
        "dynamodb", endpoint_url=os.environ.get("AWS_ENDPOINT_URL_DYNAMODB")
    )
    now = int(time.time())
    connected_at = now * 1000
    # (YEAR)(MONTH)(DAY)(HOUR)(0001-0010), as autopush.db.generate_last_connect
    last_connect = int("%s%04d" % (time.strftime("%Y%m%d%H", time.gmtime()), 3))
    db.Table(router_name).put_item(
        Item={
            "uaid": uaid,
            "router_type": "webpush",
            "node_id": "http://old-node:8081",
            "connected_at": connected_at,
            "last_connect": last_connect,
            "current_month": message_name,
        }
    )
    messages = db.Table(message_name)
    # The channel set: dashed as Python autopush normalised them, and one
    # written as hex.
    messages.put_item(
        Item={
            "uaid": uaid,
            "chidmessageid": " ",
            "chids": {chid_a, chid_b.replace("-", "")},
        }
    )
    sortkey_timestamp = int(time.time() * 1000000)
    messages.put_item(
        Item={
            "uaid": uaid,
            "chidmessageid": "02:%d:%s" % (sortkey_timestamp, chid_b),
            "sortkey_timestamp": sortkey_timestamp,
            "updateid": "legacy-plain",
            "data": "cGxhaW4",
            "headers": {"encoding": "aes128gcm"},
            "ttl": 600,
            "timestamp": now,
            "expiry": now + 600,
        }
    )
    messages.put_item(
        Item={
            "uaid": uaid,
            "chidmessageid": "01:%s:%s" % (chid_a, "scores"),
            "updateid": "legacy-topic",
            "data": "dG9waWM",
            "headers": {"encoding": "aesgcm", "encryption": "salt=abc", "crypto_key": "dh=def"},
            "ttl": 600,
            "timestamp": now,
            "expiry": now + 600,
        }
    )
    messages.put_item(
        Item={
            "uaid": uaid,
            "chidmessageid": "02:%d:%s" % (sortkey_timestamp - 5, chid_a),
            "sortkey_timestamp": sortkey_timestamp - 5,
            "updateid": "legacy-expired",
            "ttl": 60,
            "timestamp": now - 120,
            "expiry": now - 60,
        }
    )
    print(json.dumps({"connected_at": connected_at, "last_connect": last_connect}))


if __name__ == "__main__":
    main()

from mmserve_client.v1 import generate_pb2 as _generate_pb2
from mmserve_client.v1 import load_pb2 as _load_pb2
from mmserve_client.v1 import models_pb2 as _models_pb2
from mmserve_client.v1 import pooling_pb2 as _pooling_pb2
from mmserve_client.v1 import tokenize_pb2 as _tokenize_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor

"""GetStateRequest on both ends of the queue protocol: the client asks, the server answers."""

from torchdata.dataloader2 import communication

TARGET = "torchdata/dataloader2/communication/protocol.py"


class ProtocolClient:
    def discard_existing_request(self, block=True):
        """Drop the answer to the request in flight; with ``block=False``, raise ``EmptyQueue`` while it has not come."""
        if self.waiting_for_response():
            try:
                response = self.response_queue.get(block=block)
            except EmptyException:
                raise EmptyQueue("queue is empty")
            self.request_served(response)

    def request_get_state(self):
        if not self.can_take_request():
            raise Exception("Can not request the state while we are still waiting response for previous request")
        request = communication.messages.GetStateRequest()
        self.request_queue.put(request)
        self.request_sent(request)


class ProtocolServer:
    def response_get_state(self, snapshot, dispatcher=None):
        if not self.have_pending_request():
            raise Exception("Attempting to reply with pending request")
        if not isinstance(self._req_received, communication.messages.GetStateRequest):
            raise Exception("Replying with a state to another type of request")
        self.response_queue.put(communication.messages.GetStateResponse(snapshot, dispatcher))
        self._req_received = None


class IterDataPipeQueueProtocolClient:
    def get_response_get_state(self, block=False, timeout=None):
        try:
            response = self.response_queue.get(block=block, timeout=timeout)
        except EmptyException:
            raise EmptyQueue("queue is empty")
        self.request_served(response)
        if isinstance(response, communication.messages.WorkerExceptionResponse):
            response.exc.reraise()
        if not isinstance(response, communication.messages.GetStateResponse):
            raise Exception("Invalid response received when expecting `GetStateResponse`")
        return response
